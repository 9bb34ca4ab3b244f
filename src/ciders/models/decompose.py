"""Algorithm 1 (ModelPrep; docs/method.md#algorithm-1-model-decomposition-modelprep): split M* into the frozen full
backbone B_F, the messenger P_M (top `a` layers) and the learnable backbone B_L (strided copy of B_F layers), and build
the two composite deployment paths:

  AdapFu  = P_M o B_F : the loaded model itself, with the messenger LoRA injected into its top layers
                        (this is also the TAKD teacher M* = P_M o B_F).
  AdapEmu = P_M o B_L : a second HF model of the same class whose decoder stack is
                        [B_L layers] + [messenger layers]; the edge model M_i.
  messenger_top       : a third, over the messenger layers only, fed hidden states as inputs_embeds:
                        the messenger + head as a function of the backbone output.
  student_stack       : a fourth, over B_L only: B_L(x) in one no-grad pass (clients reuse it for every
                        gradient evaluation of a step, since B_L is frozen within a round).

Nothing large is copied. Embeddings, final norm, rotary embedding and LM head are the same module
objects in every path. A B_L layer is a new module whose base weights are the very Parameters of
the B_F layer it was sampled from (LoRA keeps them frozen), plus its own student LoRA. The
messenger in AdapEmu is a second module tree over the same Parameters (base and LoRA) as the
messenger in AdapFu: it needs its own module objects only because `self_attn.layer_idx` (the KV-cache
slot) differs between the paths: transformers indexes the KV cache by it, so a wrong layer_idx silently breaks
cached decoding (tests/models/test_decompose.py compares cached and uncached generation).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ciders.config import LoraConfig
from ciders.errors import CidersError
from ciders.models import adapters as ad
from ciders.models.load import decoder_layers
from ciders.models.split import Split, split_layers
from ciders.runtime import derive_seed

MESSENGER = "messenger"
STUDENT = "student"


def _tied_copy(layer: nn.Module, new_idx: int, config_swap: dict) -> nn.Module:
    """A new module tree over the same Parameters/buffers as `layer`, with layer_idx = new_idx and
    its config references replaced (deepcopy's memo maps an object's id to its replacement)."""
    memo: dict[int, object] = {id(p): p for p in layer.parameters()}
    memo.update({id(b): b for b in layer.buffers()})
    memo.update(config_swap)
    new = copy.deepcopy(layer, memo)
    for m in new.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            m.layer_idx = new_idx
        # transformers' output-capturing hooks belong to the model they were installed for
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for hid, fn in list(hooks.items()):
                if getattr(fn, "__name__", "") == "output_capturing_hook":
                    del hooks[hid]
    return new


def composite(base: nn.Module, source_idx: list[int], src_layers: nn.ModuleList) -> nn.Module:
    """A model of base's class whose decoder stack is tied copies of `src_layers[source_idx]`
    (renumbered 0..len-1) and whose every other module IS base's (embeddings, norm, rotary, head).
    Its config is a deep copy with num_hidden_layers / layer_types matching the stack."""
    cfg = copy.deepcopy(base.config)
    cfg.num_hidden_layers = len(source_idx)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [base.config.layer_types[i] for i in source_idx]
    layers = [_tied_copy(src_layers[s], j, {id(base.config): cfg}) for j, s in enumerate(source_idx)]
    with torch.device("meta"):  # no memory: every parameter is replaced below
        shell = type(base)(cfg)
    if shell.config is not cfg:
        raise CidersError(f"cannot compose {type(base).__name__}: the model copied its config")
    for name, _ in list(shell.named_children()):
        if name != "model":
            setattr(shell, name, getattr(base, name))
    for name, _ in list(shell.model.named_children()):
        if name != "layers":
            setattr(shell.model, name, getattr(base.model, name))
    shell.model.layers = nn.ModuleList(layers)
    shell.generation_config = copy.deepcopy(base.generation_config)
    left = [n for n, t in list(shell.named_parameters()) + list(shell.named_buffers()) if t.is_meta]
    if left:
        raise CidersError(f"cannot compose {type(base).__name__}: unshared modules remain ({left[0]}, ...)")
    return shell


@dataclass(eq=False)
class Decomposition:
    """The three parts and the composite paths. Adapter *values* are explicit state (see
    `messenger_state` / `student_state`); the models are the compute they are loaded into."""

    base: nn.Module  # M* with messenger LoRA in its top layers; == AdapFu
    adapemu: nn.Module  # [B_L] + [P_M]
    messenger_top: nn.Module  # [P_M] + norm + head over given hidden states (inputs_embeds): M*(x) from
    #                           cached B_F(x) in TAKD; M_i(x) from B_L(x), which is frozen within a round
    student_stack: nn.Module  # [B_L] only; its last hidden state (un-normed) is B_L(x), the messenger input
    split: Split
    messenger_lora: LoraConfig | None
    student_lora: LoraConfig | None
    model_name: str | None = None

    # ---- parts
    @property
    def adapfu(self) -> nn.Module:
        return self.base

    @property
    def backbone_full(self) -> nn.ModuleList:
        """B_F: layers 0..n-a-1 of M* (frozen teacher)."""
        return self.base.model.layers[: self.split.teacher_layers]

    @property
    def messenger(self) -> nn.ModuleList:
        """P_M as it sits in AdapFu (layers n-a..n-1)."""
        return self.base.model.layers[self.split.teacher_layers :]

    @property
    def student(self) -> nn.ModuleList:
        """B_L: layers 0..n'-1 of AdapEmu."""
        return self.adapemu.model.layers[: self.split.student_layers]

    def backbone_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """B_L(x) [B, T, H] without gradients."""
        n = self.split.student_layers
        with torch.no_grad():
            out = self.student_stack.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=[n])
        return out.hidden_states[n]

    @property
    def device(self) -> torch.device:
        return self.base.model.embed_tokens.weight.device

    # ---- adapter state
    def messenger_params(self) -> dict[str, nn.Parameter]:
        return ad.adapter_params(self.base, MESSENGER)

    def student_params(self) -> dict[str, nn.Parameter]:
        return ad.adapter_params(self.adapemu, STUDENT)

    def messenger_state(self) -> ad.State:
        return ad.get_state(self.messenger_params())

    def student_state(self) -> ad.State:
        return ad.get_state(self.student_params())

    def load_messenger(self, state: ad.State) -> None:
        ad.set_state(self.messenger_params(), state, "messenger")

    def load_student(self, state: ad.State) -> None:
        ad.set_state(self.student_params(), state, "student")

    def emulator_base_params(self) -> dict[str, nn.Parameter]:
        """The frozen base weights an edge client runs AdapEmu with: embeddings, B_L's layers, the
        messenger's layers, norm and head (tied weights once); no adapter, nothing of B_F."""
        adapters = {id(p) for p in list(self.messenger_params().values()) + list(self.student_params().values())}
        return {n: p for n, p in self.adapemu.named_parameters() if id(p) not in adapters}

    def emulator_base_state(self) -> ad.State:
        return {k: p.detach() for k, p in self.emulator_base_params().items()}

    def load_emulator_base(self, state: ad.State) -> None:
        params = self.emulator_base_params()
        if state.keys() != params.keys():
            raise CidersError(f"emulator weights do not match this model's ({len(state)} vs {len(params)} tensors)")
        with torch.no_grad():
            for k, p in params.items():
                if state[k].data_ptr() != p.data_ptr():  # in-process, the server's own tensors arrive
                    p.copy_(state[k])

    def param_names(self, part: str, model: nn.Module) -> dict[str, str]:
        """Canonical key -> parameter name inside `model` (for torch.func.functional_call)."""
        params = self.messenger_params() if part == MESSENGER else self.student_params()
        by_id = {id(p): k for k, p in params.items()}
        return {by_id[id(p)]: n for n, p in model.named_parameters() if id(p) in by_id}

    def set_trainable(self, messenger: bool, student: bool) -> None:
        for p in self.messenger_params().values():
            p.requires_grad_(messenger)
        for p in self.student_params().values():
            p.requires_grad_(student)

    # ---- PEFT directories
    def save_messenger(self, path: str | Path, state: ad.State | None = None) -> Path:
        """Standard PEFT adapter over the ORIGINAL model's messenger layers."""
        self._need(self.messenger_lora, "messenger")
        idx = list(self.split.messenger_indices)
        return ad.save_adapter(
            path, state if state is not None else self.messenger_state(), self.messenger_lora,
            idx, self.model_name, meta={**self._meta(MESSENGER), "targets": "base model", "layer_indices": idx},
            readme=f"# CIDERS messenger LoRA\n\nTargets the base model `{self.model_name}` at its own layer indices "
                   f"{idx} (its top {len(idx)} layers): it loads onto the base model with PEFT as it is.\n",
        )

    def save_student(self, path: str | Path, state: ad.State | None = None) -> Path:
        """Standard PEFT adapter over AdapEmu's layers 0..n'-1."""
        self._need(self.student_lora, "student")
        s, n = self.split, self.split.student_layers
        return ad.save_adapter(
            path, state if state is not None else self.student_state(), self.student_lora,
            range(n), self.model_name,
            meta={**self._meta(STUDENT), "targets": "AdapEmu (B_L)", "layer_indices": list(range(n)),
                  "base_layer_indices": list(s.student_indices)},
            readme=f"# CIDERS student LoRA (the compressed backbone B_L)\n\nTargets **AdapEmu's** layers 0..{n - 1}, "
                   f"which are B_L: the base model's layers {list(s.student_indices)} (a strided subsample of "
                   f"`{self.model_name}`'s {s.n_layers}). Its layer indices are B_L's, not the base model's. "
                   f"Loaded onto the base model it would land on the base model's layers 0..{n - 1}, the wrong "
                   "ones. Load it onto AdapEmu (the compressed model `ciders export` writes, or "
                   "`Decomposition.load_student`).\n",
        )

    def read_adapter(self, path: str | Path, part: str) -> ad.State:
        state, meta = ad.load_adapter(path)
        if meta and meta.get("part") not in (None, part):
            raise CidersError(f"{path}: this is a {meta.get('part')} adapter, not a {part} adapter")
        if meta and "split" in meta and meta["split"] != self._meta(part)["split"]:
            raise CidersError(f"{path}: saved for split {meta['split']}, this model is {self._meta(part)['split']}")
        params = self.messenger_params() if part == MESSENGER else self.student_params()
        ad.check_state(params, state, f"{path}")
        return state

    def _meta(self, part: str) -> dict:
        s = self.split
        return {"part": part, "model": self.model_name,
                "split": {"n_layers": s.n_layers, "messenger_layers": s.messenger_layers,
                          "student_indices": list(s.student_indices)}}

    @staticmethod
    def _need(cfg: LoraConfig | None, what: str) -> None:
        if cfg is None:
            raise CidersError(f"this decomposition has no {what} LoRA")


def decompose(
    model: nn.Module,
    messenger_layers: int,
    *,
    beta: float | None = None,
    drop_ratio: float | None = None,
    student_layers: int | None = None,
    rounding: str = "round",
    messenger_lora: LoraConfig | None = LoraConfig(),
    student_lora: LoraConfig | None = LoraConfig(),
    seed: int = 0,
    model_name: str | None = None,
) -> Decomposition:
    """Algorithm 1 steps 2-6 on a loaded model (takes ownership of `model`: the messenger LoRA is
    injected into it in place). TAKD pre-alignment (step 8) is `ciders.models.distill`.

    Split arguments as in `split_layers`; LoRA configs None = no adapter on that part."""
    layers = decoder_layers(model)
    split = split_layers(len(layers), messenger_layers, beta=beta, drop_ratio=drop_ratio,
                         student_layers=student_layers, rounding=rounding)
    if any(isinstance(m, _lora_layer_type()) for m in model.modules()):
        raise CidersError("decompose() expects a plain model; this one already carries LoRA layers")
    for p in model.parameters():
        p.requires_grad_(False)

    msg_idx = list(split.messenger_indices)
    messenger_lora = None if messenger_lora is None else ad.resolve_targets(layers[0], messenger_lora)
    student_lora = None if student_lora is None else ad.resolve_targets(layers[0], student_lora)
    if messenger_lora is not None:
        ad.inject_lora(model, messenger_lora, msg_idx, MESSENGER, seed=derive_seed(seed, "messenger-lora-init"))
    n_s = split.student_layers
    adapemu = composite(model, list(split.student_indices) + msg_idx, layers)
    if student_lora is not None:
        ad.inject_lora(adapemu, student_lora, range(n_s), STUDENT, seed=derive_seed(seed, "student-lora-init"))
    messenger_top = composite(model, msg_idx, layers)
    student_stack = composite(adapemu, list(range(n_s)), adapemu.model.layers)
    student_stack.config.tie_last_hidden_states = False  # hidden_states[-1] = raw B_L output, not normed
    for m in (model, adapemu, messenger_top, student_stack):
        m.eval()
    d = Decomposition(model, adapemu, messenger_top, student_stack, split, messenger_lora, student_lora, model_name)
    d.set_trainable(messenger=True, student=True)
    return d


def _lora_layer_type():
    from peft.tuners.lora import LoraLayer

    return LoraLayer
