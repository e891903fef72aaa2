from .candidate_generator import DFlashCandidateGenerator
from .enable import enable, is_enabled
from .stats import DFlashStats

__all__ = ["DFlashCandidateGenerator", "DFlashStats", "enable", "is_enabled"]
