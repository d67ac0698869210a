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

# A projection's kernel for m rows, by its native kind and whether the layers run it row by row.
_ROW_KINDS = {("bf16", False): native.PROJ_BF16, ("bf16", True): native.PROJ_BF16, ("bf16-rows", False): native.PROJ_BF16_ROWS,
              ("quant", False): native.PROJ_QUANT, ("quant", True): native.PROJ_QUANT_EACH}


def _projection_table(projections: list, rows_max: int, keep: list) -> ctypes.Array | None:
    """Each projection's kernel for 1..rows_max rows, in step_bf16.c's order, or None where one of
    them is not compiled code."""
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


def _projections(model) -> list:
    """The model's projections in step_bf16.c's order: each layer's mixer in and out, gate_up and
    down, then the head."""
    def mixer(m):
        return (m.qkv_proj, m.o_proj) if isinstance(m, GatedAttention) else (m.in_proj, m.out_proj)

    return [p for layer in model.layers for p in (*mixer(layer.mixer), layer.mlp.gate_up, layer.mlp.down)] + [model.lm_head]


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
        gdn_floats = 1
        for i, layer in enumerate(model.layers):
            mixer, mlp, l = layer.mixer, layer.mlp, layers[i]
            keep += [layer.input_norm.scale, layer.post_norm.scale]
            l.in_scale, l.post_scale = layer.input_norm.scale.data_ptr(), layer.post_norm.scale.data_ptr()
            l.in_eps, l.post_eps = layer.input_norm.eps, layer.post_norm.eps
            l.inter = mlp.gate_up.weight.shape[0] // 2
            if isinstance(mixer, GatedAttention):
                l.full = 1
                keep += [mixer.q_norm.scale, mixer.k_norm.scale]
                l.q_scale, l.k_scale, l.qk_eps = mixer.q_norm.scale.data_ptr(), mixer.k_norm.scale.data_ptr(), mixer.q_norm.eps
                l.attn_scale, l.heads, l.kv_heads, l.head_dim = mixer.scale, mixer.heads, mixer.kv_heads, mixer.head_dim
                l.half = model.rotary.cos_sin(0, 1)[0].shape[-1]
            else:
                l.full = 0
                keep += [mixer.conv_taps, mixer.neg_a, mixer.dt_bias, mixer.norm.weight]
                l.taps, l.neg_a = mixer.conv_taps.data_ptr(), mixer.neg_a.data_ptr()
                l.dt_bias, l.norm_w, l.norm_eps = mixer.dt_bias.data_ptr(), mixer.norm.weight.data_ptr(), mixer.norm.eps
                l.hk, l.hv, l.dk, l.dv, l.kernel = mixer.hk, mixer.hv, mixer.dk, mixer.dv, mixer.conv_taps.shape[0]
                gdn_floats = max(gdn_floats, fused_kernels.gdn_work(mixer.hk, mixer.hv, mixer.dk, mixer.dv).numel())
        projections = _projections(model)
        # Several sequences' rows in one call (`rows`) where the engine is batch-invariant (each row
        # then gets the bits it gets alone, which the layers' kernels for several rows give it too)
        # and every projection's kernel for each row count is compiled code; else one row a call,
        # and the engine runs a pass of several rows layer by layer.
        rows_max = min(p.kernels.rows_max for p in projections) if engine.invariant else 1
        table = _projection_table(projections, rows_max, keep) if rows_max > 1 else None
        if table is not None:
            self.rows = self._rows
        else:
            rows_max, table = 1, _projection_table(projections, 1, keep)
        h = cfg.hidden_size
        # At TP=1 the head holds the whole vocab: its rows are the logits.
        self.vocab_rows = model.lm_head.weight.shape[0]
        # Each scratch buffer's size a row (step_bf16.c's struct step says which is which): the
        # mixer's input projection or gate_up out, the mixer's output or the activation in.
        one = [table[i * rows_max] for i in range(len(projections))]
        self._row_sizes = {
            "h": h, "x": h, "y": h, "proj_out": max(p.rows for i, p in enumerate(one[:-1]) if i % 4 in (0, 2)),
            "mid": max(p.n for i, p in enumerate(one[:-1]) if i % 4 in (1, 3)), "head_row": self.vocab_rows,
        }
        self._gdn_floats = gdn_floats
        keep += [layers, table, model.norm.scale]
        self.step = native.Step(
            len(model.layers), h, ctypes.addressof(layers), model.norm.scale.data_ptr(), model.norm.eps, ctypes.addressof(table), rows_max,
            **native.op_addresses(), threads=threads, attention_parallel_min=fused_kernels.ATTENTION_PARALLEL_MIN,
        )
        self._scratch(1)
        self.layers = layers
        embed = model.embed.weight
        keep.append(embed)
        self.embed_rows, self.embed_at, self.row_bytes = embed.shape[0], embed.data_ptr(), h * embed.element_size()
        self.rotary = model.rotary
        # Where greedy() has the step write the logits it takes the argmax of.
        self._greedy_logits = torch.empty(self.vocab_rows, dtype=torch.float32)
        self._seqs: dict[int, tuple[list, ctypes.Array]] = {}  # each slot's state, as step_bf16.c reads it
        self._rows_work: dict[int, torch.Tensor] = {}  # each attention layer's per-thread scratch (rows)

    def _scratch(self, count: int) -> None:
        """The step's scratch for at least `count` rows (grown as asked, never shrunk)."""
        if self.step.capacity >= count:
            return
        self._buffers = {name: torch.empty(count * size, dtype=torch.bfloat16) for name, size in self._row_sizes.items()}
        self._buffers["gdn_work"] = torch.empty(count * self._gdn_floats, dtype=torch.float32)
        for name, t in self._buffers.items():
            setattr(self.step, name, t.data_ptr())
        self.step.capacity = count

    def _seq(self, slot: int) -> int:
        """The address of the slot's state per layer, as step_bf16.c reads it (described again
        when the slot holds another sequence's list)."""
        states = self.slots[slot]
        bound = self._seqs.get(slot)
        if bound is None or bound[0] is not states:
            seq = (native.SeqLayer * len(states))()
            for i, (s, state) in enumerate(zip(seq, states)):
                for field, value in state.addresses().items():
                    setattr(s, field, value)
                if self.layers[i].full:
                    self._attention_work(i, s.block_size)
            bound = self._seqs[slot] = (states, seq)
        return ctypes.addressof(bound[1])

    def _attention_work(self, i: int, block_size: int) -> None:
        """Attention layer i's scratch (the layers' own, kept per shape for the process), big enough
        for this block size and a split over every thread; and, for several rows' attention a row
        per thread, one row's scratch on one range of blocks for each thread."""
        l = self.layers[i]
        threads = max(1, self.threads)
        l.attn_work = fused_kernels.attention_work(l.heads, l.kv_heads, l.head_dim, block_size, threads).data_ptr()
        if hasattr(self, "rows") and threads > 1:
            one = fused_kernels.attention_work(l.heads, l.kv_heads, l.head_dim, block_size, 1).numel()
            work = self._rows_work.get(i)
            if work is None or work.numel() < threads * one:
                work = self._rows_work[i] = torch.empty(threads * one, dtype=torch.float32)
            l.attn_rows_work, l.attn_rows_stride = work.data_ptr(), one

    def logits(self, token: int, pos: int, slot: int) -> torch.Tensor:
        """The model's forward for one sequence's decode row, fed a token id at position pos, its
        rotary row read from the model's table: fp32 logits [vocab], with no torch op on the way
        but their allocation."""
        logits = torch.empty(self.vocab_rows, dtype=torch.float32)
        self._run(token, pos, slot, logits.data_ptr())
        return logits

    def greedy(self, token: int, pos: int, slot: int) -> int:
        """The same step's argmax, found in C over logits it keeps for that: no torch op at all.
        Python's part of a step runs on caches the step's weights have just swept, where each
        torch op costs several times what it does warm (docs/decode.md)."""
        out = self._greedy_logits.data_ptr()
        self._run(token, pos, slot, out)
        return native.argmax_at(out, self.vocab_rows)

    def _rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Several sequences' decode rows in one call, row i the token tokens[i] at positions[i] in
        slot slots[i] (each its own sequence): fp32 logits [rows, vocab], each row's bits those
        logits() gives it alone. Set as `rows` only where that holds (__init__)."""
        count = len(tokens)
        self._threads()
        for token in tokens:
            self._check_token(token)
        self._scratch(count)
        seqs = [self._seq(slot) for slot in slots]
        rotary = [self.rotary.row_addresses(pos) for pos in positions]
        addresses = ctypes.c_void_p * count
        logits = torch.empty(count, self.vocab_rows, dtype=torch.float32)
        native.run_rows(
            self.step, count, addresses(*(self.embed_at + t * self.row_bytes for t in tokens)), (ctypes.c_int64 * count)(*positions),
            addresses(*(c for c, _ in rotary)), addresses(*(s for _, s in rotary)), addresses(*seqs), logits.data_ptr(),
        )
        return logits

    def _threads(self) -> None:
        threads = torch.get_num_threads()
        if threads != self.threads:
            # Attention splits its cache over torch's threads, as its layer path does per call.
            self.threads = self.step.threads = threads
            self._seqs = {}

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.embed_rows:
            raise IndexError(f"token id {token} is outside the embedding's {self.embed_rows} rows")

    def _run(self, token: int, pos: int, slot: int, logits: int) -> None:
        self._threads()
        self._check_token(token)
        native.run(self.step, self.embed_at + token * self.row_bytes, pos, *self.rotary.row_addresses(pos), self._seq(slot), logits)
