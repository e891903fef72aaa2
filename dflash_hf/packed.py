"""Packed linear weights: a CPU forward over k tokens at what the weights' bytes cost, not k skinny GEMMs.

Eager `F.linear` on a CPU runs a few rows far below what streaming the weight once costs: SmolLM2-135M's
lm_head (576 x 49,152) took 9.7 ms for 1 row and 15.2 for 8 in float32 (bfloat16 3.2 and 5.3) on an AMD EPYC
with AVX512-BF16, so a verify forward over 8 tokens cost 1.6x a token's there and 2.2-3.5x on other CPUs.
oneDNN multiplies by a weight reordered once into its blocked layout: 4.1 and 4.3 ms (bfloat16 1.7 and 2.0).
That is the op pair inductor's `freezing` pass emits for CPU linears (`mkldnn._reorder_linear_weight` to pack,
`mkldnn._linear_pointwise` to multiply), called here without a compiler: no compile time, no graph per width,
no static cache to size. One pack serves every row count (a pack made for 8 rows ran 1 to 32 rows at full
speed there; in float32 one made for 1 row was 1.5-2x slower at 8-16 rows, hence the `rows` hint).

`pack_linears(model)` swaps each `nn.Linear` for a `PackedLinear` holding the same `Parameter`s (tied weights
stay tied, `state_dict` is unchanged) plus the packed copy: one more copy of the linear weights in memory
(`packed_bytes`; SmolLM2-135M: +513 MiB in float32, +256 MiB in bfloat16, its tied lm_head included).
`unpack_linears` undoes it. A `PackedLinear` computes `F.linear` wherever the packed op does not apply: off the
CPU, in another dtype than float32/bfloat16, when gradients are needed, inside a `torch.compile` graph, and on
a torch whose private oneDNN ops are missing (`packed_ops_available`); its packed copy is redone when the
weight changes (a `.to()`, an optimizer step).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_ops_available() -> bool:
    """Whether this torch has oneDNN's packed-linear ops (private: `torch.ops.mkldnn._reorder_linear_weight` and
    `_linear_pointwise`, stable since torch 2.0 but not promised) and oneDNN is on."""
    return torch.backends.mkldnn.enabled and _ops_present()


@functools.cache  # asked at every forward: the ops do not come and go within a process
def _ops_present() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by a oneDNN-packed copy of its weight on the CPU (see the module docstring).

    Args:
        weight (`nn.Parameter`): `(out_features, in_features)`, shared with the module it replaces.
        bias (`nn.Parameter`, *optional*): shared likewise.
        rows (`int`, defaults to 8): the row count the layout is chosen for (any count runs).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, rows: int = 8):
        nn.Module.__init__(self)  # no fresh weights: the replaced module's parameters are taken over
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.rows = weight, bias, rows
        self._packed, self._packed_from = None, None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rows: int = 8) -> "PackedLinear":
        return cls(linear.weight, linear.bias, rows)

    def to_linear(self) -> nn.Linear:
        """A plain `nn.Linear` with the same parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def _packs(self, x: torch.Tensor) -> bool:
        weight = self.weight
        if not (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
                and weight.dtype in PACKED_DTYPES and x.shape[-1] == self.in_features
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return False
        # Under torch.compile, F.linear: inductor cannot lower the packed op on a weight it did not pack itself
        # (a LoweringException in torch 2.13), and packs linears itself where `freezing` is on.
        return not torch.compiler.is_compiling() and packed_ops_available()

    def packed_weight(self) -> torch.Tensor:
        """The packed copy, redone when the weight was replaced or changed in place since it was made."""
        weight = self.weight
        # (an inference tensor, made under `torch.inference_mode`, keeps no version: its storage alone tells)
        source = (weight.data_ptr(), None if weight.is_inference() else weight._version, weight.dtype)
        if self._packed is None or self._packed_from != source:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.rows)
            self._packed_from = source
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packs(x):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed for {self.rows} rows"


def pack_linears(model: nn.Module, rows: int = 8) -> nn.Module:
    """Swaps every `nn.Linear` of `model` (in place) for a `PackedLinear` on the same parameters, packs the CPU
    ones now (`packed_bytes` tells the memory it took), and returns `model`.

    The switch of the CPU fast path, for plain `generate` and DFlash alike (DFlash packs a drafter with its
    packed target). `rows`: the verify width the layout is chosen for (8, the shipped drafter's block). Raises
    `TypeError` for something that is not an `nn.Module`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pack_linears takes an nn.Module (a transformers model), got {type(model).__name__}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # exactly: quantised or otherwise special linears keep their own forward
                setattr(parent, name, PackedLinear.from_linear(child, rows))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, PackedLinear) and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and (
                packed_ops_available()):
            module.packed_weight()
    return model


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by `model`'s packed weight copies (the fast path's memory, on top of the weights)."""
    return sum(m._packed.nbytes for m in model.modules() if isinstance(m, PackedLinear) and m._packed is not None)


def unpack_linears(model: nn.Module) -> nn.Module:
    """Undoes `pack_linears` (in place; frees the packed copies); returns `model`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())
    return model


def is_packed(model: nn.Module) -> bool:
    """Whether any linear of `model` is a `PackedLinear`."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def path_name(model: nn.Module) -> str:
    """How `model` computes: its dtype, and `packed` where its linears are (`"bfloat16 packed"`, `"float32"`)."""
    return path_label(str(next(model.parameters()).dtype).removeprefix("torch."), is_packed(model))


def path_label(dtype: str, packed: bool) -> str:
    """The name `path_name` gives a model in `dtype`, packed or not."""
    return f"{dtype} packed" if packed else dtype


__all__ = ["PACKED_DTYPES", "PackedLinear", "is_packed", "pack_linears", "packed_bytes", "packed_ops_available",
           "path_label", "path_name", "unpack_linears"]
