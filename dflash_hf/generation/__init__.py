from .api import dflash_decode, dflash_settings, enable, generate, is_enabled
from .candidate_generator import DFlashCandidateGenerator
from .stats import DFlashGenerateOutput, DFlashStats

__all__ = ["DFlashCandidateGenerator", "DFlashGenerateOutput", "DFlashStats", "dflash_decode", "dflash_settings",
           "enable", "generate", "is_enabled"]
