"""What /metrics reports, in Prometheus' text format: running and waiting requests, requests ended
(by how), prompt and generated tokens, generated tokens per second over the last window, time
to first token, the KV cache pool's use and preemptions, and the prefix cache's hits and misses. The HTTP process's link thread records
what the engine process sends; any thread renders."""

from __future__ import annotations

import math
import threading
import time
from collections import deque

# Generated tokens/s is taken over this many trailing seconds.
RATE_WINDOW_S = 10.0
# Time-to-first-token quantiles are taken over this many latest requests.
TTFT_SAMPLES = 1000
QUANTILES = (0.5, 0.9, 0.99)
PREFIX = "pocketllm"


class Metrics:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.started = clock()
        self.ended: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step
        self._ttft: deque[float] = deque(maxlen=TTFT_SAMPLES)
        self._ttft_sum = 0.0
        self._ttft_count = 0

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def tokens(self, n: int) -> None:
        now = self._clock()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append(seconds)
            self._ttft_sum += seconds
            self._ttft_count += 1

    def ended_with(self, how: str) -> None:
        """how: stop, length, cancelled (its client left, or the server stopped) or error; a stop string counts as stop."""
        with self._lock:
            self.ended[how] = self.ended.get(how, 0) + 1

    def tokens_per_second(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            window = min(RATE_WINDOW_S, now - self.started)
            return sum(n for _, n in self._recent) / window if window > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def render(self, running: int, waiting: int, kv=None) -> str:
        """kv: the scheduler's KVUsage (the pool's blocks, preemptions, the prefix cache's counts)."""
        rate = self.tokens_per_second()
        with self._lock:
            ttft = sorted(self._ttft)
            lines = [
                _gauge("requests_running", "requests the scheduler is generating for", running),
                _gauge("requests_waiting", "requests waiting for a free slot", waiting),
                f"# HELP {PREFIX}_requests_ended_total requests ended, by how they ended",
                f"# TYPE {PREFIX}_requests_ended_total counter",
                *(f'{PREFIX}_requests_ended_total{{how="{how}"}} {n}' for how, n in sorted(self.ended.items())),
                _counter("prompt_tokens_total", "prompt tokens of admitted requests", self.prompt_tokens),
                _counter("generation_tokens_total", "tokens generated", self.generated_tokens),
                _gauge("generation_tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:g} s", round(rate, 3)),
                f"# HELP {PREFIX}_time_to_first_token_seconds from a request's arrival to its first token (quantiles over the last {TTFT_SAMPLES})",
                f"# TYPE {PREFIX}_time_to_first_token_seconds summary",
                *(f'{PREFIX}_time_to_first_token_seconds{{quantile="{q}"}} {_quantile(ttft, q):.6f}' for q in QUANTILES if ttft),
                f"{PREFIX}_time_to_first_token_seconds_sum {self._ttft_sum:.6f}",
                f"{PREFIX}_time_to_first_token_seconds_count {self._ttft_count}",
            ]
        if kv is not None:
            lines += [
                _gauge("kv_cache_blocks_total", f"KV cache blocks in the pool, {kv.block_size} positions each", kv.blocks_total),
                _gauge("kv_cache_blocks_used", "KV cache blocks held by running requests (cached prefixes' are counted apart)", kv.blocks_used),
                _gauge("kv_cache_usage_ratio", "fraction of the KV cache blocks in use", round(kv.blocks_used / max(1, kv.blocks_total), 6)),
                _counter("preemptions_total", "requests whose KV blocks were taken back to be recomputed later", kv.preemptions),
            ]
            if kv.prefix_caching:
                lines += [
                    _counter("prefix_cache_hits_total", "requests started from a cached prefix", kv.prefix_hits),
                    _counter("prefix_cache_misses_total", "requests started with nothing cached", kv.prefix_misses),
                    _counter("prefix_cache_hit_tokens_total", "prompt positions not run, taken from the cache", kv.prefix_hit_tokens),
                    _gauge("prefix_cache_entries", "cached prefixes", kv.prefix_entries),
                    _gauge("prefix_cache_blocks", "KV cache blocks held by cached prefixes alone, given back when requests need them", kv.prefix_blocks),
                ]
        return "\n".join(lines) + "\n"


def _gauge(name: str, help_text: str, value) -> str:
    return f"# HELP {PREFIX}_{name} {help_text}\n# TYPE {PREFIX}_{name} gauge\n{PREFIX}_{name} {value}"


def _counter(name: str, help_text: str, value) -> str:
    return f"# HELP {PREFIX}_{name} {help_text}\n# TYPE {PREFIX}_{name} counter\n{PREFIX}_{name} {value}"


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted values."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def parse(text: str) -> dict[str, float]:
    """Prometheus text back into {name or name{labels}: value}, for tests and the load benchmark."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
