"""How far quantized weights move a model's logits: each weight format against the unquantized
model's fp32 logits on the same checkpoint and text, next to llama.cpp's quantized formats of the
same weights against its own f32 logits.

Text is cut into --chunks chunks of --ctx tokens, each run as a fresh sequence; the positions
scored are each chunk's second half (ctx/2 .. ctx-2), as `llama-perplexity --kl-divergence`
scores them, so the two engines' figures cover the same positions of the same tokens. For each
setting: the relative logit error ||l - l_ref|| / ||l_ref|| over every scored position, the mean
KL(ref || setting) of the next-token distributions, top-1 agreement, and (pocketllm only) the
relative error of the projection weights themselves, ||W_q - W|| / ||W|| over all of them.
pocketllm's settings: bf16 (unquantized, bf16 arithmetic), int8, int4 at each group size
symmetric and asymmetric, and the checkpoint converted to Qwen's FP8 release format, loaded as
int8 (the default) and as exact floats (`--quantize none`). llama.cpp's (with
--llama-perplexity and --gguf-dir holding {name}-f32/bf16/Q8_0/Q4_0/Q4_K_M.gguf): bf16, Q8_0,
Q4_0, Q4_K_M against its f32 run; it prints no logit error, so that column is left empty.

With --decode-schemes, the same positions are also scored as a decode step scores them: bf16
activations, each position one step after a prefill of the chunk's first half, with the int4
one-row kernel forced to each of --decode-kernels in turn (c-int8x rounds x to int8 first; the
others take it as it is), so the error that kernel's rounding adds shows beside the scheme's own.

    python benchmarks/quant_accuracy.py --ckpt DIR [--text FILE] [--ctx 512] [--chunks 8]
        [--llama-perplexity PATH --gguf-dir DIR --gguf-name small] [--json F]
        [--decode-schemes int4-g32,int4-g128 --decode-kernels c-prefetch,c-int8x]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from common import Parser, PocketRunner, absolute_path, at_least, executable, existing_dir, existing_file, positive_int, scheme_list, script
from safetensors.torch import load_file, save_file

from pocketllm.engine.runner import Engine
from pocketllm.errors import UsageError
from pocketllm.model_args import check_out_path
from pocketllm.loader.fp8 import to_fp8_blocks
from pocketllm.loader.model_tensors import projection_keys
from pocketllm.ops.quant.layout import QuantizedWeight, dequantize

REPO = Path(__file__).resolve().parents[1]
# llama.cpp's formats of the checkpoint, the reference first.
LLAMA_KINDS = ("f32", "bf16", "Q8_0", "Q4_0", "Q4_K_M")
SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym", "int4-g64-asym", "int4-g128-asym"]
# llama-perplexity keeps its KL statistics to itself under this many scored positions.
LLAMA_MIN_SCORED = 100


def parse_args(argv=None):
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ckpt", required=True, type=absolute_path, help="float checkpoint (bf16, as released)")
    p.add_argument("--text", type=existing_file, help="text file (default: the repository's docs, concatenated)")
    # Each chunk scores positions ctx/2 .. ctx-2: at least one needs ctx >= 4.
    p.add_argument("--ctx", type=at_least(4), default=512)
    p.add_argument("--chunks", type=positive_int, default=8)
    p.add_argument("--schemes", type=scheme_list, default=",".join(SCHEMES))
    p.add_argument("--llama-perplexity", type=executable, help="path of llama.cpp's llama-perplexity")
    p.add_argument("--gguf-dir", type=existing_dir, help="directory of the same checkpoint's GGUFs, {name}-{f32,bf16,Q8_0,Q4_0,Q4_K_M}.gguf")
    p.add_argument("--gguf-name", default="small")
    p.add_argument("--json", help="write the table here too")
    p.add_argument("--decode-schemes", type=scheme_list, default="", help="int4 schemes also scored by bf16 decode steps (e.g. int4-g32,int4-g128)")
    p.add_argument("--decode-kernels", default="c-prefetch,c-int8x", help="the int4 one-row kernels those decode steps are forced to")
    args = p.parse_args(argv)
    if (args.llama_perplexity is None) != (args.gguf_dir is None):
        p.error("--llama-perplexity and --gguf-dir go together")
    scored = args.chunks * (args.ctx // 2 - 1)
    if args.llama_perplexity and scored < LLAMA_MIN_SCORED:
        p.error(f"--ctx {args.ctx} x --chunks {args.chunks} scores {scored} positions: llama-perplexity gives no KL statistics "
                f"under {LLAMA_MIN_SCORED} (its rows would be empty)")
    if any(not s.startswith("int4") for s in args.decode_schemes):
        p.error(f"--decode-schemes takes int4 schemes (the int4 one-row kernels are forced), got {','.join(args.decode_schemes)}")
    if args.gguf_dir:
        missing = [f for f in (f"{args.gguf_dir}/{args.gguf_name}-{kind}.gguf" for kind in LLAMA_KINDS) if not os.path.isfile(f)]
        if missing:
            p.error(f"--gguf-dir: no {', '.join(missing)}")
    return args


def text_of(args) -> str:
    if args.text:
        return Path(args.text).read_text()
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def engine(ckpt: str, dtype: str, quantize: str | None) -> Engine:
    return PocketRunner(ckpt, dtype, quantize).engine


def scored_logits(e: Engine, ids: list[int], ctx: int, chunks: int) -> torch.Tensor:
    """fp32 logits at every scored position [chunks * (ctx/2 - 1), V]."""
    out = []
    for c in range(chunks):
        chunk = torch.tensor(ids[c * ctx : (c + 1) * ctx])
        e.reserve_slots(1, ctx)
        out.append(e.run_packed([(0, 0, chunk)], all_logits=True)[ctx // 2 : ctx - 1].float())
    return torch.cat(out)


def decoded_logits(e: Engine, ids: list[int], ctx: int, chunks: int) -> torch.Tensor:
    """The scored positions' logits, each from a one-row decode step after a prefill of the
    chunk's first half."""
    out = []
    for c in range(chunks):
        chunk = torch.tensor(ids[c * ctx : (c + 1) * ctx])
        e.reserve_slots(1, ctx)
        e.run_packed([(0, 0, chunk[: ctx // 2])])
        out += [e.run_packed([(0, p, chunk[p : p + 1])]).float() for p in range(ctx // 2, ctx - 1)]
    return torch.cat(out)


def forced_engine(ckpt: str, dtype: str, quantize: str, kernels: str) -> Engine:
    """An engine with the kernels `kernels` names forced (POCKETLLM_KERNELS, read at load)."""
    before = os.environ.get("POCKETLLM_KERNELS")
    os.environ["POCKETLLM_KERNELS"] = kernels
    try:
        return engine(ckpt, dtype, quantize)
    finally:
        if before is None:
            os.environ.pop("POCKETLLM_KERNELS")
        else:
            os.environ["POCKETLLM_KERNELS"] = before


def weight_error(e: Engine, ref: Engine) -> float:
    """||W - W_ref|| / ||W_ref|| over every projection and head weight, as the run holds them."""
    num = den = 0.0
    for w, r in zip(e.model.projection_weights(), ref.model.projection_weights()):
        wf, rf = (dequantize(w) if isinstance(w, QuantizedWeight) else w.float()), r.float()
        num += float((wf - rf).pow(2).sum())
        den += float(rf.pow(2).sum())
    return (num / den) ** 0.5


def compare(logits: torch.Tensor, ref: torch.Tensor, ref_logp: torch.Tensor) -> dict:
    logp = torch.log_softmax(logits, -1)
    return {
        "rel_logit_error": float((logits - ref).norm() / ref.norm()),
        "mean_kl": float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()),
        "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def fp8_release(src: str, out: Path) -> None:
    """The checkpoint in Qwen's FP8 release format: every projection e4m3 with 128x128 block
    scales, the head and the rest left as they are."""
    out.mkdir()
    from pocketllm.config import load_config

    keys = set(projection_keys(load_config(src))) - {"lm_head.weight"}
    tensors = {}
    for name, t in load_file(f"{src}/model.safetensors").items():
        if name in keys:
            tensors[name], tensors[name + "_scale_inv"] = to_fp8_blocks(t)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads(Path(src, "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(Path(src, "tokenizer.json"), out / "tokenizer.json")


def run_llama(cmd: list[str]) -> str:
    """llama-perplexity's output; where it fails, its own last line, as this script's one line."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"status {r.returncode}"
        raise UsageError(f"llama-perplexity failed ({how}) on {cmd[cmd.index('-m') + 1]}: {lines[-1] if lines else 'no output'}")
    return r.stdout + r.stderr


def llama_rows(args, text_file: str) -> dict[str, dict]:
    gguf = lambda kind: str(Path(args.gguf_dir) / f"{args.gguf_name}-{kind}.gguf")  # noqa: E731
    common = [args.llama_perplexity, "-f", text_file, "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{tmp}/base.kld"
        text = run_llama([*common, "-m", gguf("f32"), "--kl-divergence-base", base])
        ppl = re.search(r"Final estimate: PPL = ([\d.]+)", text)
        print(f"llama.cpp f32 perplexity over the same positions: {ppl.group(1) if ppl else '?'}", flush=True)
        rows = {}
        for kind in LLAMA_KINDS[1:]:
            text = run_llama([*common, "-m", gguf(kind), "--kl-divergence-base", base, "--kl-divergence"])
            kl = re.search(r"Mean\s+KLD:\s+([-\d.e]+)", text)
            top = re.search(r"Same top p:\s+([\d.]+)", text)
            rows[f"llama.cpp {kind}"] = {"rel_logit_error": None, "mean_kl": float(kl.group(1)) if kl else None, "top1_agreement": float(top.group(1)) / 100 if top else None}
        return rows


@script
def main(argv=None) -> int:
    args = parse_args(argv)
    check_out_path(args.json, "--json", args.ckpt)
    if not os.path.isfile(f"{args.ckpt}/tokenizer.json"):
        raise UsageError(f"--ckpt {args.ckpt}: no tokenizer.json (write the checkpoint with `pocketllm make-checkpoint`)")
    from tokenizers import Tokenizer

    text = text_of(args)
    ids = Tokenizer.from_file(f"{args.ckpt}/tokenizer.json").encode(text).ids
    need = args.ctx * args.chunks
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, {need} are needed")
    print(f"{args.chunks} chunks of {args.ctx} tokens, {args.chunks * (args.ctx // 2 - 1)} scored positions", flush=True)
    reference = engine(args.ckpt, "float32", None)
    ref = scored_logits(reference, ids, args.ctx, args.chunks)
    ref_logp = torch.log_softmax(ref, -1)
    targets = torch.tensor([ids[c * args.ctx + j + 1] for c in range(args.chunks) for j in range(args.ctx // 2, args.ctx - 1)])
    # Same tokens and positions as llama-perplexity's: its f32 perplexity must equal this.
    ppl = float(torch.exp(-ref_logp.gather(1, targets[:, None]).mean()))
    print(f"pocketllm fp32 perplexity over the scored positions: {ppl:.4f}", flush=True)
    rows: dict[str, dict] = {}

    def add(name, e):
        rows[name] = {**compare(scored_logits(e, ids, args.ctx, args.chunks), ref, ref_logp), "weight_rel_error": weight_error(e, reference)}
        print(name, rows[name], flush=True)

    add("pocketllm bf16", engine(args.ckpt, "bfloat16", None))
    for scheme in args.schemes:
        add(f"pocketllm {scheme}", engine(args.ckpt, "float32", scheme))
    for scheme in args.decode_schemes:
        for kernel in args.decode_kernels.split(","):
            e = forced_engine(args.ckpt, "bfloat16", scheme, f"int4-one-row={kernel}")
            name = f"pocketllm {scheme}, bf16 decode steps, {kernel}"
            rows[name] = {**compare(decoded_logits(e, ids, args.ctx, args.chunks), ref, ref_logp), "weight_rel_error": weight_error(e, reference)}
            print(name, rows[name], flush=True)
            del e
    with tempfile.TemporaryDirectory() as tmp:
        fp8 = Path(tmp) / "fp8"
        fp8_release(args.ckpt, fp8)
        add("pocketllm fp8 -> int8 (default)", engine(str(fp8), "float32", None))
        add("pocketllm fp8 as floats", engine(str(fp8), "float32", "none"))
        if args.llama_perplexity:
            text_file = f"{tmp}/text.txt"
            Path(text_file).write_text(text)
            rows.update(llama_rows(args, text_file))
    print("\n| setting | rel. logit error | mean KL | top-1 agreement | weight rel. error |")
    print("|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for name, r in rows.items():
        print(f"| {name} | {fmt(r['rel_logit_error'], '.4f')} | {fmt(r['mean_kl'], '.6f')} | {fmt(r['top1_agreement'], '.3f')} | {fmt(r.get('weight_rel_error'), '.4f')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ctx": args.ctx, "chunks": args.chunks, "fp32_perplexity": ppl, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
