from .candidate_generator import DFlashCandidateGenerator
from .decoding import DFlashGenerateOutput, dflash_decode, enable, generate, is_enabled
from .stats import DFlashStats

__all__ = ["DFlashCandidateGenerator", "DFlashGenerateOutput", "DFlashStats", "dflash_decode", "enable", "generate",
           "is_enabled"]
