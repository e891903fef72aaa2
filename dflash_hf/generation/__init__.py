from .candidate_generator import DFlashCandidateGenerator
from .decoding import dflash_decode, enable, generate, is_enabled
from .stats import DFlashGenerateOutput, DFlashStats

__all__ = ["DFlashCandidateGenerator", "DFlashGenerateOutput", "DFlashStats", "dflash_decode", "enable", "generate",
           "is_enabled"]
