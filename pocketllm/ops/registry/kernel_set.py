"""The chosen set an engine owns, and what each projection layer is bound to.

KernelSet holds one Choice per (kind, weight format): one row, many rows, and each few-row count
asked for. `bind(weight)` resolves, once, which kernel (and which prepared form of the weight)
every row count of a call on that weight runs: the layer keeps the result and calls it, so where a
projection runs, the kernel it runs is in the layer (`layer.kernels`), not in a table elsewhere.
"""

from __future__ import annotations

import os

import torch

from pocketllm.ops.registry.choose import Choice, choose
from pocketllm.ops.registry.kinds import FEW, MANY, ONE, batch_invariant, few_rows_for, kind_for, row_class, weight_device, weight_format
from pocketllm.ops.registry.measure import key_of
from pocketllm.ops.registry.trust import Monitor


# How an entry runs a call of r rows: its one-row kernel on the row, its kernel on all rows, or its
# one-row kernel on each row in turn.
_ONE, _ROWS, _EACH = "one", "rows", "each"


class BoundKernels:
    """x [T, in] -> [T, out] on one weight, by the kernel resolved for T rows. `names` says which
    kernel each row count runs. `alone(x)` gives every row the bits the one-row kernel gives it
    alone, however many rows the call has (a batch-invariant set's few-row kernels do; a call of
    more rows than they were chosen for is split into calls they cover)."""

    def __init__(self, weight, small: dict[int, tuple], many: tuple):
        # Entries are (name, kernel, prepared weight, form); `small` holds one for every row count
        # from 1 up to the largest with a kernel of its own, and any count past them runs `many`.
        self.weight = weight
        self.out_features = weight.shape[0]
        self.names = {(ONE if r == 1 else f"{r}-row"): e[0] for r, e in small.items()} | {MANY: many[0]}
        self._small = [many[1:]] + [small[r][1:] for r in range(1, len(small) + 1)]
        self._many = many[1:3]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        if rows < len(self._small):
            _run(self._small[rows], x, out)
        else:
            self._many[0](x, self._many[1], out)
        return out

    def many(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The many-row kernel, whatever the row count (a prompt segment's rows)."""
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        self._many[0](x, self._many[1], out)
        return out

    def alone(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows that are each their own sequence's decode row: each summed as it is alone. Bound
        by a batch-invariant set, every small entry does so; past them, calls of the largest."""
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        step = len(self._small) - 1
        if rows <= step:
            _run(self._small[rows], x, out)
            return out
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            _run(self._small[r1 - r0], x[r0:r1], out[r0:r1])
        return out

    def one_row_native(self) -> tuple | None:
        """The one-row kernel as compiled code calls it (its run's `native`: kind, entry point,
        weight address, rows, n and its two settings), or None where it is not compiled code."""
        run, w, _ = self._small[1]
        native = getattr(run, "native", None)
        return None if native is None else native(w)

    @property
    def rows_max(self) -> int:
        """The most rows one call of a small entry takes (rows_native's range)."""
        return len(self._small) - 1

    def rows_native(self, rows: int) -> tuple | None:
        """The kernel `rows` rows run (1..rows_max) as compiled code calls it: the native tuple
        (kind, entry point, weight address, rows, n, a, b) and whether it runs on each row in turn,
        or None where it is not compiled code."""
        run, w, form = self._small[rows]
        native = getattr(run, "native", None)
        return None if native is None else (*native(w), form == _EACH)

    def __repr__(self) -> str:
        return "BoundKernels(" + ", ".join(f"{k} {v}" for k, v in self.names.items()) + ")"


def _run(entry: tuple, x: torch.Tensor, out: torch.Tensor) -> None:
    run, w, form = entry
    if form == _ROWS:
        run(x, w, out)
    elif form == _ONE:
        run(x[0], w, out[0])
    else:
        for i in range(x.shape[0]):
            run(x[i], w, out[i])


def projection_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain form of a bound projection on a plain weight: what BoundKernels must equal."""
    result = x @ w.t()
    if out is None:
        return result
    out.copy_(result)
    return out


class KernelSet:
    """The kernels chosen for an engine's projection weights. An empty set binds every weight to
    its kinds' defaults (torch's own calls)."""

    def __init__(self, choices: list[Choice] | None = None, env=os.environ, monitor: Monitor | None = None, device_type: str = "cpu"):
        self.env = env
        # Rows summed in the one-row kernel's order (a few-row call otherwise runs the one-row
        # kernel on each row in turn) is how a CPU keeps a decode row's bits in any batch. A
        # device's kernels are the kinds' defaults, torch's calls, which have no such order: there
        # it would read the weights once per row of a step. A device that is asked for invariance
        # gets it from its pass shape instead (layers/context.py: a step of fixed rows).
        self.invariant = batch_invariant(env) and device_type == "cpu"
        self.monitor = monitor or Monitor()
        self._runs_here: set[tuple] = set()  # kernels _check_runs found runnable
        self.choices: list[Choice] = []
        for c in choices or []:
            self.add(c)

    @classmethod
    def choose(cls, weights: list, env=os.environ, peers=()) -> KernelSet:
        """One-row and many-row choices for every format among `weights` (the model's projection
        weights in step order). `peers`: the pids of the other ranks, which measure at the same
        time (their CPU time is not another process's)."""
        device_type = weight_device(weights[0]).type if weights else "cpu"
        chosen = cls(env=env, monitor=Monitor(peers), device_type=device_type)
        for fmt, ws in _by_format(weights).items():
            for rows in (ONE, MANY):
                kind = kind_for(fmt, rows)
                if kind is None:
                    raise ValueError(f"no {rows} kernel kind is declared for {fmt} weights")
                chosen.add(choose(kind, ws, env=env, monitor=chosen.monitor))
        return chosen

    def add(self, choice: Choice) -> None:
        self.choices = [c for c in self.choices if (c.kind, c.fmt, c.rows) != (choice.kind, choice.fmt, choice.rows)] + [choice]

    def choose_few(self, weights: list, count: int) -> list[Choice]:
        """Few-row choices for steps of up to `count` rows that this set does not hold yet: the
        new ones (a format without a few-row kind runs few rows with its many-row kernel)."""
        new = []
        for fmt, ws in _by_format(weights).items():
            kind = kind_for(fmt, FEW)
            if kind is None:
                continue
            have = {c.rows for c in self.choices if c.kind is kind and c.fmt == fmt}
            # Batch-invariant, each weight's few-row kernel sums like its one-row choice.
            one = self._find(fmt, ONE)
            orders = None
            if self.invariant and one is not None:
                orders = {key_of(kind, w): one.kind.by_name[one.kernel_for(w)].row_order for w in ws}
            for rows in few_rows_for(count):
                if rows not in have:
                    new.append(choose(kind, ws, rows=rows, env=self.env, monitor=self.monitor, orders=orders))
                    self.add(new[-1])
        return new

    def _find(self, fmt: str, rows: str, count: int = 1) -> Choice | None:
        return next((c for c in self.choices if c.fmt == fmt and c.kind.rows == rows and c.rows == count), None)

    def bind(self, weight) -> BoundKernels:
        """The kernels `weight` runs at every row count, resolved now, with the prepared forms
        they run on (one per layout). Batch-invariant (the default), a few-row count runs its
        chosen kernel only when that sums each row in the one-row kernel's order, and otherwise
        the few-row form of the one-row choice where its kind has one, else the one-row kernel on
        each row in turn: a decode row gets the same bits in any batch."""
        fmt = weight_format(weight)
        forms: dict[str, object] = {}

        def entry(rows: str, choice: Choice | None, form: str, name: str | None = None) -> tuple:
            kind = choice.kind if choice is not None else kind_for(fmt, rows)
            if kind is None:
                raise ValueError(f"no {rows} kernel kind is declared for {fmt} weights")
            name = name or (choice.kernel_for(weight) if choice is not None else kind.default)
            cand = kind.by_name[name]
            self._check_runs(kind, cand, fmt, weight)
            if form == _ONE and cand.takes_rows:
                form = _ROWS
            if cand.prepare is None:
                return name, cand.run, weight, form
            layout = f"{kind.family}:{cand.layout or name}"
            if layout not in forms:
                forms[layout] = cand.prepare(weight)
            return name, cand.run, forms[layout], form

        def order(e: tuple, rows: str) -> str:
            kind = kind_for(fmt, rows)
            return kind.by_name[e[0]].row_order if kind is not None and e[0] in kind.by_name else ""

        def few_like(one_entry: tuple):
            kind = kind_for(fmt, FEW)
            name = one_entry[0]
            if kind is None or name not in kind.by_name or not order(one_entry, ONE) or kind.by_name[name].row_order != order(one_entry, ONE):
                return None
            return entry(FEW, None, _ROWS, name)

        many = entry(MANY, self._find(fmt, MANY), _ROWS)
        one = entry(ONE, self._find(fmt, ONE), _ONE)
        each = (f"{one[0]} per row",) + one[1:3] + (_EACH,)
        same = few_like(one)
        counts = sorted(c.rows for c in self.choices if c.fmt == fmt and c.kind.rows == FEW)
        small = {1: one}
        for rows in range(2, max(counts, default=1) + 1):
            # A pass of r rows runs the few-row choice made for the smallest count at or above r
            # that covers this weight's shape; none: the many-row kernel.
            covering = [c for c in (self._find(fmt, FEW, n) for n in counts if n >= rows) if key_of(c.kind, weight) in c.by_key]
            e = entry(FEW, covering[0], _ROWS) if row_class(rows) == FEW and covering else many
            if self.invariant and not (e is not many and order(e, FEW) and order(e, FEW) == order(one, ONE)):
                # The few-row form of the one-row choice where the kind has it (one call, each row
                # summed as alone); else the one-row kernel on each row in turn.
                e = same if same is not None and row_class(rows) == FEW else each
            small[rows] = e
        return BoundKernels(weight, small, many)

    def _check_runs(self, kind, cand, fmt: str, weight) -> None:
        """A kernel runs only where its unavailable() says it can, which also builds and loads
        what it calls: choose() checks what it picks, and a set made by hand (as tests make them)
        is checked here, once per kernel, at bind rather than on every call."""
        key = (kind.name, kind.family, cand.name, fmt)
        if key in self._runs_here:
            return
        why = cand.unavailable(fmt, weight_device(weight))
        if why:
            raise ValueError(f"{kind.name} kernel {cand.name} cannot run here: {why}")
        self._runs_here.add(key)

    def describe(self) -> list[str]:
        """One line per choice, for rank 0 to print: a few-row choice whose rows run otherwise
        (bind: batch-invariant, no few-row kernel sums like the one-row choice) says what runs."""
        return [self.line(c) for c in self.choices]

    def line(self, c: Choice) -> str:
        instead = self._instead(c)
        shown = ", ".join(f"{k[0]}x{k[1]} {name}" if isinstance(k, tuple) else name for k, name in instead.items())
        return c.describe() + (f"; batch-invariant, what runs instead: {shown}" if instead else "")

    def to_json(self) -> list[dict]:
        out = []
        for c in self.choices:
            doc = c.to_json()
            for key, name in self._instead(c).items():
                doc["runs"][f"{key[0]}x{key[1]}" if isinstance(key, tuple) else c.probe or key] = name
            out.append(doc)
        return out

    def runs(self, c: Choice, weight) -> str:
        """What `weight`'s calls of choice `c` run once bound: its chosen kernel, or what bind()
        gives instead (the one-row choice's few-row form, or "NAME per row")."""
        return self._instead(c).get(key_of(c.kind, weight), c.kernel_for(weight))

    def _instead(self, c: Choice) -> dict:
        """The keys of a few-row choice `c` whose calls bind() gives another kernel, and what they
        run: the few-row form of the one-row choice, or that kernel on each row in turn."""
        one = self._find(c.fmt, ONE)
        if not self.invariant or c.kind.rows != FEW or one is None:
            return {}
        out = {}
        for key in c.by_key:
            mine, theirs = c.runs(key), one.runs(key)
            order = one.kind.by_name[theirs].row_order
            if order and c.kind.by_name[mine].row_order == order:
                continue
            same = c.kind.by_name.get(theirs)
            out[key] = theirs if same is not None and order and same.row_order == order else f"{theirs} per row"
        return out


def _by_format(weights: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for w in weights:
        out.setdefault(weight_format(w), []).append(w)
    return out


DEFAULTS = KernelSet()


def default_kernels(weight) -> BoundKernels:
    """The kernels a projection runs before an engine binds its own: each kind's default."""
    return DEFAULTS.bind(weight)
