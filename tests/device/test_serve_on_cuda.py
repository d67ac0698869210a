"""`pocketllm serve --device cuda` against the real OpenAI client: it decodes on the captured graphs
(its stderr says so), a request alone gets `pocketllm generate --device cuda`'s tokens, and eight
concurrent requests (one pass of eight decode rows, bucket 8) each complete in full, the answers
the same when the load is repeated. By default a device promises no batch invariance
(docs/devices.md), so there the concurrent answers are not held to the lone ones; a server asked
for it (POCKETLLM_BATCH_INVARIANT=1) is."""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import pytest

from device_caps import cuda_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import generated_ids, run_cli, start  # noqa: E402
from test_serve import KEY, MAX_LEN, MODEL, NEW, PROMPTS, ready, serving, stop, text_ckpt  # noqa: E402, F401  (text_ckpt: a fixture)

pytestmark = pytest.mark.skipif(cuda_count() == 0, reason="no CUDA device")


# A server's first start on a machine compiles fla's kernels for this model's head sizes (about
# 90 s cold) and the engine's Triton kernels, and captures its graphs, before it serves.
DEVICE_START_S = 240


@pytest.fixture(scope="module")
def cuda_server(text_ckpt, tmp_path_factory):  # noqa: F811
    yield from serving(text_ckpt, 1, tmp_path_factory.mktemp("serve-cuda"), "--device", "cuda", "--max-running", 8, start_timeout=DEVICE_START_S)


def _complete(server, prompt: str) -> tuple[list[int], str | None]:
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason


@pytest.mark.timeout(480)
def test_serve_on_cuda_decodes_on_the_graphs(cuda_server, text_ckpt, tokenizer):  # noqa: F811
    assert "decode step: cuda graph (B buckets 1,2,4,8)" in cuda_server.run.stderr, cuda_server.run.stderr
    alone = {p: _complete(cuda_server, p) for p in PROMPTS}
    for prompt, (ids, reason) in alone.items():
        r = run_cli("generate", "--ckpt", text_ckpt, "--device", "cuda", "--token-ids", ",".join(map(str, tokenizer.encode(prompt).ids)),
                    "--max-new-tokens", NEW, timeout=300)
        assert r.returncode == 0, r.stderr
        assert (ids, reason) == (generated_ids(r.stdout), "length"), prompt
    # Eight at once, twice: every answer whole. Their tokens are not compared: by default a device
    # promises no batch invariance (which requests share a pass, and the bucket a step replays,
    # follow the requests' timing, and a bf16 near tie can go either way); the test below holds the
    # batch-invariant shape to it.
    load = PROMPTS * 2
    for _ in range(2):
        with concurrent.futures.ThreadPoolExecutor(len(load)) as pool:
            answers = list(pool.map(lambda p: _complete(cuda_server, p), load))
        assert all(len(ids) == NEW and reason == "length" for ids, reason in answers), answers


@pytest.fixture(scope="module")
def tokenizer(text_ckpt):  # noqa: F811
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(text_ckpt / "tokenizer.json"))


@pytest.fixture(scope="module")
def invariant_server(text_ckpt, tmp_path_factory):  # noqa: F811
    run = start("serve", "--ckpt", text_ckpt, "--tp-world", 1, "--port", 0, "--max-len", MAX_LEN, "--api-key", KEY, "--device", "cuda",
                "--max-running", 8, tmp_path=tmp_path_factory.mktemp("serve-cuda-invariant"), env={"POCKETLLM_BATCH_INVARIANT": "1"})
    yield ready(run, 1, DEVICE_START_S)
    stop(run)


@pytest.mark.timeout(480)
def test_asked_for_batch_invariance_concurrent_answers_are_the_lone_ones(invariant_server):
    """The device's batch-invariant shape (one captured step of 8 rows): each of eight concurrent
    requests gets the tokens it gets alone, with requests scoring their prompts (echo with logprobs,
    which read every prompt row's logits) beside them too."""
    assert "decode step: cuda graph (every step at 8 rows: batch-invariant)" in invariant_server.run.stderr, invariant_server.run.stderr
    alone = {p: _complete(invariant_server, p) for p in PROMPTS}
    load = PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(len(load)) as pool:
        together = list(pool.map(lambda p: _complete(invariant_server, p), load))
    assert together == [alone[p] for p in load]

    def score(prompt: str) -> list:
        r = invariant_server.client.completions.create(model=MODEL, prompt=prompt * 20, max_tokens=0, echo=True, logprobs=1)
        return r.choices[0].logprobs.token_logprobs

    with concurrent.futures.ThreadPoolExecutor(len(load) + 4) as pool:
        scored = [pool.submit(score, p) for p in PROMPTS]
        together = list(pool.map(lambda p: _complete(invariant_server, p), load))
        scores = [f.result() for f in scored]
    assert together == [alone[p] for p in load]
    assert all(s[0] is None and len(s) > 20 and all(v is not None for v in s[1:]) for s in scores)
