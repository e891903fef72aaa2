"""Finding and loading the DFlash kernels with the `kernels` library, or deciding not to.

Where they come from: the kernel repository in this source tree (`<root>/kernels/dflash-kernels`,
next to `<root>/dflash_hf`) through `kernels.get_local_kernel`; otherwise (an installed wheel) the
Hub repository `dflash-hf/dflash-kernels` through `kernels.get_kernel`, pinned to `HUB_VERSION`.

Which path runs: `backend=` or the `DFLASH_KERNELS` environment variable, one of
- `auto` (default): the Triton kernels where they can run (a GPU, or CPU under
  `TRITON_INTERPRET=1`), else the PyTorch reference, with one warning saying why;
- `triton`: the kernels or an error;
- `torch`: the PyTorch reference.
"""

import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "DFLASH_KERNELS"
BACKENDS = ("auto", "triton", "torch")
HUB_REPO_ID = "dflash-hf/dflash-kernels"
HUB_VERSION = 2  # the kernel API version this package calls (`version` in build.toml)
KERNEL_API = ("block_attention", "greedy_verify", "rejection_verify")

# (backend, source, version, revision, interpreting) -> module or None.
_LOADED: dict[tuple, ModuleType | None] = {}
_LOGGED: set[str] = set()  # each decision is logged once per process, however many keys reach it


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


def resolve_backend(backend: str | None = None) -> str:
    """`backend`, else `$DFLASH_KERNELS`, else `auto`; ValueError for anything else."""
    value = backend if backend is not None else os.environ.get(ENV_VAR) or "auto"
    value = str(value).strip().lower()
    if value not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{source} must be one of {BACKENDS}, got {value!r}.")
    return value


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (`TRITON_INTERPRET=1`), which also takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def local_kernel_repo() -> Path | None:
    """`<root>/kernels/dflash-kernels` of a source checkout, or None (e.g. installed from a wheel)."""
    path = Path(__file__).resolve().parents[2] / "kernels" / "dflash-kernels"
    return path if (path / "build").is_dir() else None


def _gpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


def _is_local(path_or_repo) -> bool:
    return isinstance(path_or_repo, Path) or os.path.isdir(path_or_repo)


def _import(path_or_repo, version, revision) -> tuple[ModuleType, str]:
    """The kernel module and where it came from; raises with the reason when it cannot be had."""
    if not interpreting() and not _gpu_available():
        raise RuntimeError("no GPU for the Triton kernels (TRITON_INTERPRET=1 runs them on CPU, slowly)")
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("Triton is not installed (pip install triton)")
    import kernels  # the `kernels` library, a dependency of this package

    if _is_local(path_or_repo):
        path = Path(path_or_repo)
        module, where = kernels.get_local_kernel(path), f"local folder {path}"
    else:
        if version is None and revision is None and path_or_repo == HUB_REPO_ID:
            version = HUB_VERSION
        # Only our own repository is trusted implicitly; any other must be from a trusted publisher.
        trusted = [HUB_REPO_ID]
        module = kernels.get_kernel(path_or_repo, version=version, revision=revision, trust_remote_code=trusted)
        pin = f"revision {revision}" if revision is not None else f"version {version}"
        where = f"Hub repository {path_or_repo} ({pin})"
    missing = [name for name in KERNEL_API if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(f"the kernel module from {where} lacks {missing}")
    return module, where


def load_kernels(
    path_or_repo: str | Path | None = None,
    version: int | None = None,
    revision: str | None = None,
    backend: str | None = None,
) -> ModuleType | None:
    """The DFlash kernel module, or None where the PyTorch reference is to run.

    Args:
        path_or_repo (`str` or `Path`, *optional*): a local kernel repository folder or a Hub repo id;
            defaults to this checkout's `kernels/dflash-kernels`, else `dflash-hf/dflash-kernels`.
        version (`int`, *optional*): the kernel version to load from the Hub (a `v<version>` branch);
            defaults to `HUB_VERSION` for `dflash-hf/dflash-kernels`.
        revision (`str`, *optional*): a Hub branch, tag or commit instead of `version`.
        backend (`str`, *optional*): `auto`, `triton` or `torch`; defaults to `$DFLASH_KERNELS`, else `auto`.

    Under `auto` a kernel that cannot load (no GPU, no Triton, repository missing or broken) logs one
    warning and returns None; under `triton` it raises RuntimeError instead.
    """
    mode = resolve_backend(backend)
    if path_or_repo is None:
        path_or_repo = local_kernel_repo() or HUB_REPO_ID
    if _is_local(path_or_repo) and (version is not None or revision is not None):
        raise ValueError("version/revision pin a Hub repository; a local kernel folder has neither.")
    key = (mode, str(path_or_repo), version, revision, interpreting())
    if key in _LOADED:
        return _LOADED[key]
    if mode == "torch":
        _log_once(logging.INFO, f"DFlash kernels: running the PyTorch reference ({ENV_VAR}=torch).")
        _LOADED[key] = None
        return None
    try:
        module, where = _import(path_or_repo, version, revision)
    except Exception as error:  # a broken kernel repo raises anything from OSError to SyntaxError
        if mode == "triton":
            raise RuntimeError(f"{ENV_VAR}=triton, but the DFlash Triton kernels cannot load: {error}") from error
        _log_once(
            logging.WARNING,
            f"DFlash kernels unavailable ({error}); running the PyTorch reference instead. Set {ENV_VAR}=torch "
            f"to choose it explicitly, or {ENV_VAR}=triton to make this an error.",
        )
        module = None
    else:
        _log_once(logging.INFO, f"DFlash kernels: running the Triton kernels from {where}.")
    _LOADED[key] = module
    return module


def kernels_for(tensor: torch.Tensor, backend: str | None = None) -> ModuleType | None:
    """The kernel module to run on `tensor`, or None for the reference. Under `auto`, CPU tensors
    outside the Triton interpreter take the reference even where a GPU build is loaded."""
    module = load_kernels(backend=backend)
    if module is None:
        return None
    if tensor.device.type == "cpu" and not interpreting() and resolve_backend(backend) == "auto":
        return None
    return module


def clear_cache() -> None:
    """Forget what `load_kernels` decided and logged (tests; after changing the environment at run time)."""
    _LOADED.clear()
    _LOGGED.clear()
