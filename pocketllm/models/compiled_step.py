"""A decode step of one sequence as one compiled call (ops/fused/step_bf16.c), where the model's
layers would make every call of it anyway: bf16 on a CPU at TP=1, the compiled decode ops on, and
every projection's one-row kernel compiled code (not a torch op). The call runs the very functions
the layers call, with the same arguments, in the same order: the same bits, without the Python
between them. A pass of several sequences' decode rows runs as one call too (`rows`) where the
engine is batch-invariant: each projection then runs its kernel for that many rows, the work
between them row by row. Anything else (a profile, a prompt's rows, another device or world, a
torch kernel chosen for some weight) takes the layers' path.

`POCKETLLM_COMPILED_STEP=0` keeps the layers' path."""

from __future__ import annotations

import ctypes
import os

import torch

from pocketllm.distributed.state import tp
from pocketllm.layers.attention import GatedAttention
from pocketllm.ops.fused import kernels as fused_kernels
from pocketllm.ops.fused import step as native
from pocketllm.switches import env_switch

ENV_STEP = "POCKETLLM_COMPILED_STEP"
_KINDS = {"bf16": native.PROJ_BF16, "quant": native.PROJ_QUANT}


def _proj(layer, keep: list) -> native.Proj:
    kind, fn, w, rows, n, a, b = layer.kernels.one_row_native()
    keep.append(layer.kernels)
    return native.Proj(_KINDS[kind], fn, w, rows, n, a, b)


# A projection's kernel for m rows, by its native kind and whether the layers run it row by row.
_ROW_KINDS = {("bf16", False): native.PROJ_BF16, ("bf16", True): native.PROJ_BF16, ("bf16-rows", False): native.PROJ_BF16_ROWS,
              ("quant", False): native.PROJ_QUANT, ("quant", True): native.PROJ_QUANT_EACH}


def _rows_projs(projections: list, rows_max: int, keep: list) -> ctypes.Array | None:
    """Each projection's kernel for 1..rows_max rows, in step_bf16.c's rows_step order, or None
    where one of them is not compiled code (those rows then take the layers' path)."""
    out = (native.Proj * (len(projections) * rows_max))()
    for i, layer in enumerate(projections):
        keep.append(layer.kernels)
        for m in range(1, rows_max + 1):
            entry = layer.kernels.rows_native(m)
            if entry is None or (entry[0], entry[-1]) not in _ROW_KINDS:
                return None
            kind, fn, w, rows, n, a, b, each = entry
            out[i * rows_max + m - 1] = native.Proj(_ROW_KINDS[(kind, each)], fn, w, rows, n, a, b)
    return out


def why_not(model, env=os.environ) -> str | None:
    """Why the model's decode steps cannot run as one call ("" when they can; None off a CPU,
    where the question does not arise)."""
    if model.embed.weight.device.type != "cpu":
        return None
    if not env_switch(env, ENV_STEP, default=True):
        return f"{ENV_STEP}=0"
    if tp().world != 1:
        return "TP>1 (each projection's all-reduce runs between the calls)"
    if not model.decode_ops.compiled:
        return "the decode ops are not compiled" + (f" ({model.decode_ops.note})" if model.decode_ops.note else "")
    if any(layer.mixer.compiled_decode is None for layer in model.layers):
        return "a mixer runs its torch path"
    torch_kernels = [m for m in model.projections() if m.kernels.one_row_native() is None]
    if torch_kernels or any(getattr(m, "blocks", None) is not None for m in model.modules() if hasattr(m, "part_sizes")):
        return "a projection's one-row kernel is a torch op" if torch_kernels else "a projection holds weights of two formats"
    lib, why = native.library()
    return "" if lib is not None else why


class CompiledStep:
    """The model's decode step of one sequence, described once (here), run per token (logits,
    greedy): the CPU backend of the engine's decode-step seam (pocketllm/engine/decode_step.py)."""

    why_not = staticmethod(why_not)

    def __init__(self, engine):
        model, self.slots = engine.model, engine.slots
        self.keep: list = []  # what the description's pointers point into
        cfg, keep = model.cfg, self.keep
        threads = torch.get_num_threads()
        self.threads = threads
        layers = (native.Layer * len(model.layers))()
        mid_max = proj_max = 0
        for i, layer in enumerate(model.layers):
            mixer, mlp, l = layer.mixer, layer.mlp, layers[i]
            keep += [layer.input_norm.scale, layer.post_norm.scale]
            l.in_scale, l.post_scale = layer.input_norm.scale.data_ptr(), layer.post_norm.scale.data_ptr()
            l.in_eps, l.post_eps = layer.input_norm.eps, layer.post_norm.eps
            l.gate_up, l.down = _proj(mlp.gate_up, keep), _proj(mlp.down, keep)
            l.inter = mlp.gate_up.weight.shape[0] // 2
            if isinstance(mixer, GatedAttention):
                l.full = 1
                l.mix_in, l.mix_out = _proj(mixer.qkv_proj, keep), _proj(mixer.o_proj, keep)
                keep += [mixer.q_norm.scale, mixer.k_norm.scale]
                l.q_scale, l.k_scale, l.qk_eps = mixer.q_norm.scale.data_ptr(), mixer.k_norm.scale.data_ptr(), mixer.q_norm.eps
                l.attn_scale, l.heads, l.kv_heads, l.head_dim = mixer.scale, mixer.heads, mixer.kv_heads, mixer.head_dim
                l.half = model.rotary.cos_sin(0, 1)[0].shape[-1]
                mid = mixer.heads * mixer.head_dim
            else:
                l.full = 0
                l.mix_in, l.mix_out = _proj(mixer.in_proj, keep), _proj(mixer.out_proj, keep)
                keep += [mixer.conv_taps, mixer.neg_a, mixer.dt_bias, mixer.norm.weight]
                l.taps, l.neg_a = mixer.conv_taps.data_ptr(), mixer.neg_a.data_ptr()
                l.dt_bias, l.norm_w, l.norm_eps = mixer.dt_bias.data_ptr(), mixer.norm.weight.data_ptr(), mixer.norm.eps
                l.hk, l.hv, l.dk, l.dv, l.kernel = mixer.hk, mixer.hv, mixer.dk, mixer.dv, mixer.conv_taps.shape[0]
                work = fused_kernels.gdn_work(mixer.hk, mixer.hv, mixer.dk, mixer.dv)
                keep.append(work)
                l.gdn_work = work.data_ptr()
                mid = mixer.hv * mixer.dv
            mid_max = max(mid_max, mid, l.inter)
            proj_max = max(proj_max, l.mix_in.rows, l.gate_up.rows)
        h = cfg.hidden_size
        # At TP=1 the head holds the whole vocab: its rows are the logits.
        self.vocab_rows = model.lm_head.weight.shape[0]
        scratch = {name: torch.empty(size, dtype=torch.bfloat16) for name, size in
                   (("h", h), ("x", h), ("y", h), ("proj", proj_max), ("mid", mid_max), ("head_row", self.vocab_rows))}
        keep += [layers, model.norm.scale, *scratch.values()]
        self.step = native.Step(
            len(model.layers), h, ctypes.addressof(layers), model.norm.scale.data_ptr(), model.norm.eps, _proj(model.lm_head, keep),
            **native.op_addresses(), threads=threads, attention_parallel_min=fused_kernels.ATTENTION_PARALLEL_MIN,
            **{name: t.data_ptr() for name, t in scratch.items()},
        )
        self.layers = layers
        embed = model.embed.weight
        keep.append(embed)
        self.embed_rows, self.embed_at, self.row_bytes = embed.shape[0], embed.data_ptr(), h * embed.element_size()
        self.rotary = model.rotary
        # Where greedy() has the step write the logits it takes the argmax of.
        self._greedy_logits = torch.empty(self.vocab_rows, dtype=torch.float32)
        self._bound: tuple[list, ctypes.Array] | None = None
        self._seqs: dict[int, tuple[list, ctypes.Array]] = {}  # each slot's, for rows()
        self._rows_setup(engine, model, h, proj_max, mid_max)

    def _rows_setup(self, engine, model, hidden: int, proj_max: int, mid_max: int) -> None:
        """The decode rows of several sequences in one call too (`rows`), where the engine is
        batch-invariant (each row then gets the bits it gets alone, which the layers' kernels for
        several rows give it too) and every projection's kernel for each row count is compiled
        code. Without `rows` the engine runs such passes layer by layer."""
        if not engine.invariant:
            return
        projections = [p for layer in model.layers for p in (
            (layer.mixer.qkv_proj, layer.mixer.o_proj) if isinstance(layer.mixer, GatedAttention) else (layer.mixer.in_proj, layer.mixer.out_proj)
        ) + (layer.mlp.gate_up, layer.mlp.down)] + [model.lm_head]
        rows_max = min(p.kernels.rows_max for p in projections)
        projs = _rows_projs(projections, rows_max, self.keep) if rows_max >= 1 else None
        if projs is None:
            return
        self._rows_projs, self._rows_max = projs, rows_max
        self._rows_sizes = {"h": hidden, "x": hidden, "y": hidden, "proj_out": proj_max, "mid": mid_max, "head_row": self.vocab_rows}
        gdn = [layer.mixer for layer in model.layers if not isinstance(layer.mixer, GatedAttention)]
        self._gdn_floats = max((fused_kernels.gdn_work(m.hk, m.hv, m.dk, m.dv).numel() for m in gdn), default=1)
        self._rows_scratch: dict[str, torch.Tensor] = {}
        self._rows_step: native.RowsStep | None = None
        self.rows = self._rows

    def _rows_buffers(self, count: int) -> native.RowsStep:
        """The rows call's description with scratch for at least `count` rows (grown as asked)."""
        if self._rows_step is None or self._rows_step.capacity < count:
            self._rows_scratch = {name: torch.empty(count * size, dtype=torch.bfloat16) for name, size in self._rows_sizes.items()}
            self._gdn_work = torch.empty(count * self._gdn_floats, dtype=torch.float32)
            self._rows_step = native.RowsStep(
                ctypes.addressof(self.step), ctypes.addressof(self._rows_projs), self._rows_max, native.gdn_rows_address(),
                self._gdn_work.data_ptr(), count, **{name: t.data_ptr() for name, t in self._rows_scratch.items()},
            )
        return self._rows_step

    def _seq(self, states: list) -> ctypes.Array:
        """The sequence's state per layer, as step_bf16.c reads it (kept while the same list comes)."""
        if self._bound is not None and self._bound[0] is states:
            return self._bound[1]
        seq = self._describe(states)
        self._bound = (states, seq)
        return seq

    def _describe(self, states: list) -> ctypes.Array:
        seq = (native.SeqLayer * len(states))()
        for i, (s, state) in enumerate(zip(seq, states)):
            for field, value in state.addresses().items():
                setattr(s, field, value)
            if self.layers[i].full:
                self._attention_work(i, s.block_size)
        return seq

    def _attention_work(self, i: int, block_size: int) -> None:
        """Attention layer i's scratch (the layers' own, kept per shape for the process), big enough
        for this block size and a split over every thread."""
        l = self.layers[i]
        l.attn_work = fused_kernels.attention_work(l.heads, l.kv_heads, l.head_dim, block_size, max(1, self.threads)).data_ptr()

    def logits(self, token: int, pos: int, slot: int) -> torch.Tensor:
        """The model's forward for one sequence's decode row, fed a token id at position pos, its
        rotary row read from the model's table: fp32 logits [vocab], with no torch op on the way
        but their allocation."""
        logits = torch.empty(self.vocab_rows, dtype=torch.float32)
        self._run(token, pos, *self.rotary.row_addresses(pos), self.slots[slot], logits.data_ptr())
        return logits

    def greedy(self, token: int, pos: int, slot: int) -> int:
        """The same step's argmax, found in C over logits it keeps for that: no torch op at all.
        Python's part of a step runs on caches the step's weights have just swept, where each
        torch op costs several times what it does warm (docs/decode.md)."""
        out = self._greedy_logits.data_ptr()
        self._run(token, pos, *self.rotary.row_addresses(pos), self.slots[slot], out)
        return native.argmax_at(out, self.vocab_rows)

    def _rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Several sequences' decode rows in one call, row i the token tokens[i] at positions[i] in
        slot slots[i] (each its own sequence): fp32 logits [rows, vocab], each row's bits those
        logits() gives it alone."""
        count = len(tokens)
        self._threads()
        for token in tokens:
            self._check_token(token)
        d = self._rows_buffers(count)
        seqs = []
        for slot in slots:
            states = self.slots[slot]
            bound = self._seqs.get(slot)
            if bound is None or bound[0] is not states:
                bound = self._seqs[slot] = (states, self._describe(states))
            seqs.append(ctypes.addressof(bound[1]))
        rotary = [self.rotary.row_addresses(pos) for pos in positions]
        addresses = ctypes.c_void_p * count
        logits = torch.empty(count, self.vocab_rows, dtype=torch.float32)
        native.run_rows(
            d, count, addresses(*(self.embed_at + t * self.row_bytes for t in tokens)), (ctypes.c_int64 * count)(*positions),
            addresses(*(c for c, _ in rotary)), addresses(*(s for _, s in rotary)), addresses(*seqs), logits.data_ptr(),
        )
        return logits

    def _threads(self) -> None:
        threads = torch.get_num_threads()
        if threads != self.threads:
            # Attention splits its cache over torch's threads, as its layer path does per call.
            self.threads = self.step.threads = threads
            self._bound = None
            self._seqs = {}

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.embed_rows:
            raise IndexError(f"token id {token} is outside the embedding's {self.embed_rows} rows")

    def _run(self, token: int, pos: int, cos: int, sin: int, states: list, logits: int) -> None:
        self._threads()
        self._check_token(token)
        native.run(self.step, self.embed_at + token * self.row_bytes, pos, cos, sin, self._seq(states), logits)
