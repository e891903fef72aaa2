from .candidate_generator import DFlashCandidateGenerator
from .decoding import DFlashGenerateOutput, DFlashStats, dflash_decode, enable, generate, is_enabled

__all__ = ["DFlashCandidateGenerator", "DFlashGenerateOutput", "DFlashStats", "dflash_decode", "enable", "generate",
           "is_enabled"]
