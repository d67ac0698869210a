"""Where a decode step's time goes, beyond the weight bytes it has to read.

One process, TP=1, the same engine as `pocketllm bench`. Interleaved over reps, it times:
- the real decode step (one compiled call where the engine runs it so, models/compiled_step.py, fed
  by the engine's decode loop, Engine.greedy_row), the same step layer by layer, and that with its
  weights copied to torch's own allocation, which
  is plain 4 KiB pages where THP is `madvise` or `never` (pocketllm.host_memory says why the engine
  avoids it; with THP `always` torch's memory may get huge pages too);
- the step layer by layer with every single-row GEMV replaced by a ready output (the rest of the
  step);
- a step cut down to its GEMVs alone (the engine's one-row kernels, as measured and chosen per
  weight shape at load and bound to each projection, over the model's own weights), and the same
  with every weight run by one candidate kernel (pocketllm.ops.registry's one-row kind: mv,
  mv-native, mm, c, c-prefetch where they run), all timed alike (common.gemv_only_step_seconds);
- the same matrices in fp32, on huge pages, summed one op at a time.
After the reps, once: one 1 GiB fp32 sum (the read bandwidth the streaming limit uses); and, for
context, one-row ops alone and right after a GEMV has streamed a weight (in turn, up to 8 of the
model's weights of 12 MiB or more that take a hidden-size row, or every weight that takes one if
none is that big) and right after a plain fp32 sum has streamed 1 to 128 MiB (whether the extra
cost starts where the streamed bytes outgrow a core's L2); and the fixed cost of one small
torch.mv with and without oneDNN.

    python benchmarks/decode_anatomy.py [--ckpt DIR | --preset small] [--steps 32] [--reps 5]
        [--dtype bfloat16] [--quantize int4] [--threads 2]

With --quantize the weights are quantized at load (as `--quantize` does) and the candidate rows
are the quantized one-row kind's timed candidates; the fp32 copies are of the dequantized weights.
"""

from __future__ import annotations

import contextlib
import glob
import statistics
import sys
import time
import warnings

import torch

from pocketllm import host_memory
from pocketllm.model_args import parse_dtype
from pocketllm.quantization import parse_scheme
from pocketllm.bench.limits import decode_weight_bytes
from pocketllm.ops.quant.layout import dequantize
from pocketllm.ops.registry import ONE, kind_for, weight_format
from common import (
    Parser, PocketRunner, absolute_path, activation_dtype, checkpoint_dir, gemv_only_step_seconds, machine, positive_int, projection_weights,
    read_bandwidths_gbps, script, spread, tensor_bytes,
)


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", type=absolute_path, help="HF checkpoint directory (default: write --preset to a temp dir)")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=positive_int, default=32, help="decode steps per timing")
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", help="a --quantize scheme to quantize the weights to at load")
    p.add_argument("--threads", type=positive_int, default=2)
    return p.parse_args(argv)


class ReadyKernels:
    """A projection's kernels that return a ready output for one row instead of reading the
    weight, and run the real ones for more rows."""

    def __init__(self, real):
        self.real, self.out_features = real, real.out_features
        # Made once: the stand-in must cost nothing per call.
        self.ready = 0.1 * torch.randn(1, real.out_features, dtype=activation_dtype(real.weight))

    def __call__(self, x, out=None):
        if x.shape[0] != 1:
            return self.real(x, out)
        return self.ready if out is None else out.copy_(self.ready)

    # The calls a pass's parts take (layers.context.Part.kernel): a prompt's rows run the real
    # kernels, a decode row gets the ready output; several decode rows together run the real
    # kernels' `alone`, as a batch-invariant pass would.
    def alone(self, x, out=None):
        if x.shape[0] != 1:
            return self.real.alone(x, out)
        return self.ready if out is None else out.copy_(self.ready)

    def many(self, x, out=None):
        return self.real.many(x, out)


class LayerByLayer:
    """While active, a decode step runs layer by layer, not as the model's one compiled call
    (which holds its weights' and kernels' addresses, so the stand-ins below must not meet it)."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step

    def __enter__(self):
        self.engine.step = None

    def __exit__(self, *exc):
        self.engine.step = self.step


class CallClock:
    """While active, the compiled step's calls are timed: what a decode loop spends outside them is
    its Python (and the caches that Python finds swept by the step)."""

    def __init__(self):
        from pocketllm.ops.fused import step as native

        self.native, self.run, self.seconds = native, native.run, 0.0

    def _timed(self, *args):
        t0 = time.perf_counter()
        self.run(*args)
        self.seconds += time.perf_counter() - t0

    def __enter__(self):
        self.seconds = 0.0
        self.native.run = self._timed
        return self

    def __exit__(self, *exc):
        self.native.run = self.run


class ReadyGemvs(LayerByLayer):
    """While active, every projection's one-row GEMV returns a ready output of the right shape
    instead of reading its weight: what is left of a step is everything but the weight streaming."""

    def __init__(self, engine):
        super().__init__(engine)
        model = engine.model
        self.layers = model.projections()
        self.real = [m.kernels for m in self.layers]
        self.ready = [ReadyKernels(k) for k in self.real]

    def __enter__(self):
        super().__enter__()
        for m, k in zip(self.layers, self.ready):
            m.kernels = k

    def __exit__(self, *exc):
        for m, k in zip(self.layers, self.real):
            m.kernels = k
        super().__exit__()


class PlainPages(LayerByLayer):
    """While active, every parameter of the model is a plain torch copy (4 KiB pages) of itself."""

    def __init__(self, engine):
        super().__init__(engine)
        self.params = list(engine.model.parameters())
        self.huge = [p.data for p in self.params]
        self.plain = [t.clone() for t in self.huge]

    def __enter__(self):
        super().__enter__()
        for p, t in zip(self.params, self.plain):
            p.data = t

    def __exit__(self, *exc):
        for p, t in zip(self.params, self.huge):
            p.data = t
        super().__exit__()


def huge_page_mib() -> float:
    """MiB of this process's anonymous memory the kernel has placed on transparent huge pages."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def sum_one_at_a_time_seconds(weights_f32: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights_f32:
        w.sum()
    return time.perf_counter() - t0


def after_us(op, before, n: int = 100) -> tuple[float, float]:
    """Median microseconds of op() alone, and right after before(i) on the i-th of n turns."""
    alone, after = [], []
    for i in range(n):
        t0 = time.perf_counter()
        op()
        alone.append(time.perf_counter() - t0)
        before(i)
        t0 = time.perf_counter()
        op()
        after.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(alone), 1e6 * statistics.median(after)


def l2_cache_text() -> str:
    """This CPU's per-core L2 size as the kernel reports it, or '?' where it does not."""
    try:
        for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
            with open(f"{index}/level") as f:
                if f.read().strip() == "2":
                    with open(f"{index}/size") as f:
                        return f.read().strip()
    except OSError:
        pass
    return "?"


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = parse_dtype(args.dtype)
    parse_scheme(args.quantize or "none")  # before a --preset checkpoint is written for it
    torch.set_num_threads(args.threads)
    runner = PocketRunner(checkpoint_dir(args), dtype, args.quantize)
    model = runner.engine.model
    weights = projection_weights(model)
    # Before the fp32 copies below, which are on huge pages too: this is the engine's own.
    huge_mib = huge_page_mib()
    weights_f32 = [host_memory.zeros(w.shape, torch.float32).copy_(w if isinstance(w, torch.Tensor) else dequantize(w)) for w in weights]
    prompt = list(range(1, 33))
    layered = LayerByLayer(runner.engine)
    ready = ReadyGemvs(runner.engine)
    plain = PlainPages(runner.engine)
    runner.decode(prompt, 2)
    print(runner.engine.describe_step(), file=sys.stderr)

    kind = kind_for(weight_format(weights[0]), ONE)
    kernels = [kind.by_name[n] for n in kind.timed(weight_format(weights[0]), torch.device("cpu"))]
    ms = {"real step": [], "step, layer by layer": [], "step, 4 KiB pages": [], "step, GEMVs ready": [], "GEMVs alone (chosen)": []}
    ms.update({f"GEMVs alone, all {c.name}": [] for c in kernels})
    ms["fp32 sums alone"] = []
    outside = {"real step": []}  # ms a step outside the compiled call
    clock = CallClock()

    def step_ms(name: str) -> None:
        with clock:
            seconds = runner.decode(prompt, args.steps)[0]
        ms[name].append(1e3 * seconds / args.steps)
        if runner.engine.step is not None:
            outside[name].append(ms[name][-1] - 1e3 * clock.seconds / args.steps)

    for rep in range(args.reps):
        step_ms("real step")
        with layered:
            ms["step, layer by layer"].append(1e3 * runner.decode(prompt, args.steps)[0] / args.steps)
        with plain:
            ms["step, 4 KiB pages"].append(1e3 * runner.decode(prompt, args.steps)[0] / args.steps)
        with ready:
            ms["step, GEMVs ready"].append(1e3 * runner.decode(prompt, args.steps)[0] / args.steps)
        ms["GEMVs alone (chosen)"].append(1e3 * gemv_only_step_seconds(model, reps=1))
        for c in kernels:
            ms[f"GEMVs alone, all {c.name}"].append(1e3 * gemv_only_step_seconds(model, reps=1, op=one_row(c.run)))
        ms["fp32 sums alone"].append(1e3 * sum_one_at_a_time_seconds(weights_f32))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    # A whole step reads every weight but the embedding table; the GEMV rows read the GEMV
    # weights alone; the fp32 row reads the fp32 copies, 4 bytes a weight whatever --dtype is.
    step_bytes = decode_weight_bytes(model)
    gemv_bytes = tensor_bytes(weights)
    f32_bytes = tensor_bytes(weights_f32)
    bandwidths = read_bandwidths_gbps()
    bandwidth = max(bandwidths.values())
    quantized = f" quantize={args.quantize}" if args.quantize else ""
    print(machine())
    print(f"{runner.engine.describe_step()}, fed by the engine's decode loop; the rows from '4 KiB pages' on run layer by layer")
    print(f"threads={args.threads} dtype={args.dtype}{quantized} reps={args.reps} steps={args.steps}; "
          f"{step_bytes / 2**20:.1f} MiB of weights per step, {gemv_bytes / 2**20:.1f} of them in "
          f"{len(weights)} GEMV weights; {huge_mib:.0f} MiB of the engine's process on huge pages")
    # As wide as the longest label: a candidate's name makes "GEMVs alone, all NAME" long.
    width = max(24, 2 + max(map(len, ms)))
    print(f"{'per decode step':<{width}}{'ms, median (min..max)':>28}{'GB/s of weights':>18}")
    for name, xs in ms.items():
        nbytes = f32_bytes if name.startswith("fp32") else step_bytes if name.startswith(("real", "step,")) else gemv_bytes
        rate = "" if name == "step, GEMVs ready" else f"{nbytes / statistics.median(xs) / 1e6:.1f}"
        print(f"{name:<{width}}{spread(xs, 2):>28}{rate:>18}")
    print(f"one 1 GiB fp32 sum: {bandwidth:.1f} GB/s, the read bandwidth of the streaming limit ("
          + ", ".join(f"{v:.1f} on {k}" for k, v in bandwidths.items()) + ")")
    if all(outside.values()):
        print("a decode loop's time outside the compiled call, us a step: " + ", ".join(f"{k} {1e3 * statistics.median(v):.0f} "
              f"({1e3 * min(v):.0f}..{1e3 * max(v):.0f})" for k, v in outside.items()))
    rest = statistics.median(ms["real step"]) - statistics.median(ms["GEMVs alone (chosen)"])
    print(f"real step minus GEMVs alone (medians of per-rep figures: a step averaged over --steps, one GEMV-only pass after a warm-up): {rest:.2f} ms; the step with GEMVs ready: "
          f"{statistics.median(ms['step, GEMVs ready']):.2f} ms")

    h = torch.randn(1, model.cfg.hidden_size, dtype=dtype)
    # One x serves every GEMV, so only weights that take a hidden-size row (not down_proj, say).
    on_hidden = [w for w in weights_f32 if w.shape[1] == model.cfg.hidden_size]
    big = [w.to(dtype) for w in on_hidden if w.numel() * dtype.itemsize >= 12 * 2**20][:8] or [w.to(dtype) for w in on_hidden]
    x = torch.randn(model.cfg.hidden_size, dtype=dtype)
    mib = [w.numel() * w.element_size() / 2**20 for w in big]
    sizes = f"{min(mib):.3g}" if min(mib) == max(mib) else f"{min(mib):.3g}..{max(mib):.3g}"
    norm = model.layers[0].input_norm
    ops = (("torch.empty(1 row)", lambda: torch.empty(1, model.cfg.hidden_size)), ("input RMSNorm, 1 row", lambda: norm(h)))
    for name, op in ops:
        alone, after = after_us(op, lambda i: torch.mv(big[i % len(big)], x))
        print(f"{name}: {alone:.1f} us alone, {after:.1f} us right after a GEMV over a "
              f"{sizes} MiB weight (one of {len(big)} in turn)")
    # Whether that cost is the streamed bytes pushing the op's code and data out of the core's
    # L2: it should appear once a plain fp32 sum streams more than the L2 holds.
    streams = {mib: torch.ones(mib * 2**20 // 4) for mib in (1, 2, 4, 8, 32, 128)}
    l2 = l2_cache_text()
    for name, op in ops:
        cells = []
        for mib, buf in streams.items():
            alone, after = after_us(op, lambda i: buf.sum())
            cells.append(f"{mib} MiB: {after - alone:.1f}")
        print(f"{name}, extra us right after an fp32 sum streams (L2 per core {l2}): " + ", ".join(cells))
    del streams
    small, x = torch.randn(64, model.cfg.hidden_size, dtype=dtype), torch.randn(model.cfg.hidden_size, dtype=dtype)
    onednn = median_us(lambda: torch.mv(small, x))
    with without_onednn():
        native = median_us(lambda: torch.mv(small, x))
    print(f"torch.mv over a cached 64 x {model.cfg.hidden_size} {args.dtype} weight: {onednn:.1f} us through oneDNN, "
          f"{native:.1f} us without")
    return 0


def one_row(kernel):
    """A one-row kernel (x [in], w, out [out]) as the op(x [1, in], w) the GEMV-only step calls."""
    outs = {}

    def op(x, w):
        out = outs.get(w.shape[0])
        if out is None:
            out = outs[w.shape[0]] = torch.empty(w.shape[0], dtype=activation_dtype(w))
        kernel(x[0], w, out)

    return op


@contextlib.contextmanager
def without_onednn():
    # The flags' setter also sets oneDNN's TF32 switch and warns that this build has no Intel GPU.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def median_us(op, n: int = 300) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
