"""Device placement without a GPU: the tiny pair *claims* to live on ``cuda:0`` and the core must follow it.

How. The models really stay on the CPU; their parameters and buffers are tagged "on the claimed device".
A ``TorchFunctionMode`` (``ClaimedAccelerator``) sees every torch call (the core's and, inside the model
forward, transformers') and

- answers ``tensor.device`` with ``cuda:0`` for tagged tensors, so ``model.device`` is ``cuda:0`` and code
  that derives a device from a model or a tensor sees the accelerator;
- redirects every call that names the claimed device (``torch.zeros(..., device=cuda:0)``, ``x.to(cuda:0)``,
  ``torch.rand(..., device=...)`` ...) to the CPU and tags its result; results computed from a tagged input are
  tagged too; ``.cpu()`` / ``.to("cpu")`` results are host tensors;
- records a violation when (a) a tensor factory (``tensor``, ``arange``, ``zeros``, ``ones``, ``full``,
  ``empty``, ``rand``, ``randn``, ``randint``, ``randperm``, ``linspace``, ``eye``) is called from
  ``sequoia_ray`` code without naming a device (it would silently land on the host); (b) any op mixes a
  tagged ("device") tensor with an untagged (host) tensor — a 0-dim host scalar is legal on CUDA and is
  allowed, a 0-dim device tensor next to a host one is not; (c) a sampling op gets a generator created for another device than the op's;
- counts the host reads of device tensors (``int(t)``, ``bool(t)``, ``.item()``, ``.tolist()``, ``.cpu()``,
  ``.to("cpu")`` ..., and the ops whose output size is read from the data: ``nonzero``, ``masked_select``,
  ``unique``, ``t[mask]``): each is a host sync on an accelerator, so the verify walk may do only one and a
  batched step none in its forwards and KV compaction.
Generators are not tensors: ``torch.Generator`` is replaced during a test by a subclass that remembers the
device it was asked for (and is a CPU generator underneath).

What it cannot see: kernels that only exist on CUDA (their numerics, bf16 behaviour), syncs that do not read a
tensor (e.g. a blocking copy hidden in a kernel), tensors built by C++ code without passing through Python
(none in the core), the speed of transfers, and device choice by other means than ``device=`` / ``.to`` /
tensors (e.g. a CUDA stream). The real thing is ``tests/gpu``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import k_ary, specinfer
from tests.tiny import noisy_copy, sharpen, tiny_model

CLAIMED = torch.device("cuda", 0)
HOST = torch.device("cpu")
FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint",
             "randperm", "linspace", "eye"}
TO_HOST = {"cpu", "numpy"}
HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}
SIZE_READS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}  # output size from the data
_DEVICE_GETTER = torch._C.TensorBase.device.__get__
_REAL_GENERATOR = torch.Generator


def _as_device(x) -> torch.device | None:
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str) and x.split(":")[0] in ("cpu", "cuda", "meta", "mps", "xpu"):
        return torch.device(x)
    return None


def _claimed(x) -> bool:
    d = _as_device(x)
    return d is not None and d.type == "cuda"


def _tagged(t: torch.Tensor) -> bool:
    return getattr(t, "_on_claimed_device", False)


def _tag(out) -> None:
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            t._on_claimed_device = True


class ClaimedGenerator(_REAL_GENERATOR):
    """A CPU generator that remembers which device it was created for."""

    def __new__(cls, device=None):
        gen = super().__new__(cls, "cpu")
        gen.asked = torch.device(device) if device is not None else HOST
        return gen

    def __init__(self, device=None) -> None:
        pass


def _masks(name: str, args) -> bool:
    """``t[mask]`` / ``t[mask] = v`` with a boolean mask: the result's size is the mask's count, read on the host."""
    if name not in ("__getitem__", "__setitem__") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _caller() -> str | None:
    """``module:line`` of the innermost frame outside torch and this harness."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _core_frame() -> str | None:
    """``module:line`` of the innermost ``sequoia_ray`` frame on the stack (who caused the op), if any."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("sequoia_ray"):
            return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


class ClaimedAccelerator(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self.host_reads: list[str] = []  # where a device tensor was read on the host (a sync on a GPU)
        self.uploads: list[str] = []  # where host data was copied to the device (pageable: a wait on a GPU)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return CLAIMED if _tagged(args[0]) else func(*args)
        if func is torch.device:  # modes see device construction too: a device is just a name, keep it
            return func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        redirected = any(_claimed(x) for x in leaves)
        names_host = any((d := _as_device(x)) is not None and d.type == "cpu" for x in leaves)
        if redirected:
            args, kwargs = pytree.tree_map(lambda x: HOST if _claimed(x) else x, (args, kwargs))
        self._check(func, kwargs, leaves, redirected)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs_tagged = any(isinstance(x, torch.Tensor) and _tagged(x) for x in leaves)
        to_host = names_host or name in TO_HOST
        if inputs_tagged and (to_host or name in HOST_READS or name in SIZE_READS or _masks(name, args)):
            self.host_reads.append(f"{_core_frame()}: {name}")
        if redirected and (name in ("tensor", "as_tensor") or name == "to" and not inputs_tagged):
            self.uploads.append(f"{_core_frame()}: {name}")
        if redirected or (inputs_tagged and not to_host):
            _tag(out)
        elif to_host and isinstance(out, torch.Tensor) and _tagged(out):
            out = out.detach()  # a real copy to the host is a new tensor; here it came back as the same object
        return out

    def _check(self, func, kwargs, leaves, redirected: bool) -> None:
        name = getattr(func, "__name__", "")
        caller = _caller()
        if name in FACTORIES and kwargs.get("device") is None and caller and caller.startswith("sequoia_ray"):
            self.violations.append(f"{caller}: torch.{name} without device= (lands on the host)")
        tensors = [x for x in leaves if isinstance(x, torch.Tensor) and (x.dim() > 0 or _tagged(x))]  # host scalars pass
        if name not in ("to", "copy_") and any(map(_tagged, tensors)) and not all(map(_tagged, tensors)):
            self.violations.append(f"{_core_frame()}: {name} mixes device and host tensors (called at {caller})")
        gen = kwargs.get("generator")
        if isinstance(gen, ClaimedGenerator):
            op_device = CLAIMED if redirected or any(map(_tagged, tensors)) else HOST
            if gen.asked.type != op_device.type:
                self.violations.append(f"{_core_frame()}: {name} on {op_device} with a generator for {gen.asked}")


def claim_accelerator(model):
    """Tag the model's parameters and buffers as living on the claimed device (they stay on the CPU)."""
    for t in [*model.parameters(), *model.buffers()]:
        t._on_claimed_device = True
    return model


@pytest.fixture
def mode(monkeypatch):
    monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
    with ClaimedAccelerator() as m:
        yield m


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_model("qwen2", seed=0), 12.0)
    draft = noisy_copy(target, scale=0.03, seed=1)
    return claim_accelerator(target), claim_accelerator(draft)


def _clean(mode: ClaimedAccelerator) -> None:
    assert not mode.violations, "device placement violations:\n" + "\n".join(dict.fromkeys(mode.violations))


# ---- the harness catches what it claims to catch --------------------------------------------------
def test_harness_flags_a_host_tensor_next_to_a_device_weight(pair, mode):
    target, _ = pair
    assert target.device == CLAIMED
    torch.nn.functional.embedding(torch.tensor([1, 2], device="cpu"), target.get_input_embeddings().weight)
    assert any("mixes device and host" in v for v in mode.violations)


def test_harness_allows_a_host_scalar_but_not_a_device_scalar_beside_a_host_tensor(mode):
    x = torch.ones(3, device=CLAIMED)
    x * torch.tensor(2.0)  # a 0-dim host tensor: legal on CUDA
    assert not mode.violations
    torch.ones(3) * x.sum()  # a 0-dim device tensor with a host vector: CUDA refuses it
    assert any("mixes device and host" in v for v in mode.violations)


def test_harness_counts_reads_of_a_size_from_the_device(mode):
    x = torch.arange(6, device=CLAIMED)
    x[x > 2]
    x.nonzero()
    x[1:3]  # a slice reads nothing
    assert [r.split(": ")[-1] for r in mode.host_reads] == ["__getitem__", "nonzero"]


def test_harness_flags_a_core_factory_without_a_device(mode):
    core = {"__name__": "sequoia_ray.probe", "torch": torch}
    exec(compile("def build():\n    return torch.zeros(3)\n", "<probe>", "exec"), core)
    core["build"]()
    assert mode.violations == ["sequoia_ray.probe:2: torch.zeros without device= (lands on the host)"]


def test_harness_flags_a_host_generator_in_a_device_op(mode):
    x = torch.zeros(4, device=CLAIMED)
    torch.rand(4, generator=torch.Generator(), device=x.device)
    assert any("with a generator for cpu" in v for v in mode.violations)


# ---- the core ----------------------------------------------------------------------------------------
def test_tree_forward_and_keep_on_the_model_device(pair, mode):
    target, _ = pair
    session = KVSession(target)
    tokens = torch.tensor([5, 6, 7, 8], device=target.device)
    logits = session.forward(tokens, torch.arange(4, device=target.device))
    allowed = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool, device=target.device)
    session.forward(torch.tensor([9, 10], device=target.device), torch.tensor([4, 4], device=target.device),
                    allowed, tree_start=0)
    session.keep(torch.tensor([0, 1, 2, 3, 5], device=target.device))
    session.truncate(3)
    assert logits.device == CLAIMED and session.length == 3
    _clean(mode)


def test_host_tokens_for_a_device_model_name_the_fix(pair, mode):
    target, _ = pair
    with pytest.raises(AssertionError, match="tokens on cpu, model on cuda:0: build it with device=session.device"):
        KVSession(target).forward(torch.tensor([1, 2], device="cpu"), torch.arange(2, device=target.device))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grow_verify_commit(pair, mode, temperature):
    target, draft = pair
    plan = specinfer(3, 3)
    params = SamplingParams(max_tokens=8, temperature=temperature)
    dw, tw = DraftWorker(draft), TargetWorker(target)
    for worker in (dw, tw):
        worker.start("r", [3, 1, 4, 1, 5], params, seed=11)
    assert dw.requests["r"].generator.asked == CLAIMED, "the draft samples on its device: a CUDA generator"
    assert tw.requests["r"].generator.asked == HOST, "the verify walk runs on the host: a host generator"
    tree = dw.grow("r", plan)
    assert tree.tokens.device == HOST, "the tree crosses to the target as host tensors"
    assert all(d.tokens.device == HOST and d.probs.device == HOST for d in tree.dists.values())
    verdict = tw.verify("r", plan, tree)
    dw.commit("r", verdict.path, verdict.tokens)
    dw.grow("r", plan)
    _clean(mode)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_matches_the_host_run(pair, monkeypatch, temperature):
    target, draft = pair
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5)

    def run():
        spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), k_ary(2, 3))
        return spec.generate([7, 3, 9], params).token_ids

    host = run()
    monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
    with ClaimedAccelerator() as mode:
        claimed = run()
    _clean(mode)
    assert claimed == host  # the redirect changes nothing but placement


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_host_draft_with_a_device_target(pair, monkeypatch, temperature):
    """The actor layout: the draft on the CPU, the target on the accelerator; trees cross as host tensors."""
    target, _ = pair
    host_draft = noisy_copy(sharpen(tiny_model("qwen2", seed=0), 12.0), scale=0.03, seed=1)  # not claimed
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5)
    monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
    with ClaimedAccelerator() as mode:
        spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(host_draft), k_ary(2, 3))
        out = spec.generate([7, 3, 9], params)
    _clean(mode)
    assert out.stats.tokens == 12 and out.stats.tokens_per_step > 1.2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_verify_walk_reads_the_device_once(mode, temperature):
    """A chain the target accepts to the end: today's per-node reads would show as 5+ host reads."""
    from sequoia_ray.draft import DraftTree
    from sequoia_ray.sampling import SparseDist
    from sequoia_ray.tree.plan import chain
    from sequoia_ray.verify import verify_tree

    plan, vocab = chain(5), 11  # 6 nodes: root + 5 levels
    logits = torch.full((plan.n, vocab), -30.0, device=CLAIMED)
    logits[torch.arange(plan.n, device=CLAIMED), torch.arange(1, plan.n + 1, device=CLAIMED)] = 30.0
    one = torch.tensor([1.0], device="cpu")
    dists = {i: SparseDist(torch.tensor([i + 1], device="cpu"), one) for i in range(plan.n - 1)}
    tree = DraftTree(torch.arange(plan.n, device="cpu"), dists if temperature else {})
    params = SamplingParams(temperature=temperature)
    verdict = verify_tree(plan, tree, logits, params, torch.Generator(device="cpu").manual_seed(0))
    assert verdict.path == list(range(plan.n)) and verdict.tokens[:-1] == list(range(1, plan.n))
    assert len(mode.host_reads) == 1, mode.host_reads
    _clean(mode)


def test_hardware_timing_synchronises_the_device(pair, mode, monkeypatch):
    from sequoia_ray.hardware import time_forward

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    target, _ = pair
    times = time_forward(target, (1, 2), context=4, repeats=1, warmup=0)
    assert set(times) == {1, 2}
    assert len(synced) >= 4 and set(synced) == {CLAIMED}, "every clock read waits for the device"
    _clean(mode)


# ---- the batched step (what serving runs): several requests in one forward per level ------------------
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [3, 1, 4, 1, 5, 9, 2, 6, 7, 7], [8, 2]]


def _serve(tw: TargetWorker, dw: DraftWorker, prompts: list[list[int]], plan, params: list[SamplingParams]):
    """Decode ``prompts`` as serving's batchers do: every round one ``grow_batch`` over the requests that need a
    tree and one ``verify_batch`` over those that hold one; a request still prefilling (``NOT_YET``) comes back
    the next round beside the others' decoding."""
    from sequoia_ray.batching import NOT_YET

    ids = [f"r{i}" for i in range(len(prompts))]
    for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
        tw.start(rid, prompt, p, seed=2 * i)
        dw.start(rid, prompt, p, seed=2 * i + 1)
    out = {rid: [] for rid in ids}
    commits, length, trees = {rid: [] for rid in ids}, {rid: len(pr) for rid, pr in zip(ids, prompts)}, {}
    while live := [r for r, p in zip(ids, params) if len(out[r]) < p.max_tokens]:
        growing = [r for r in live if r not in trees]
        for r, tree in zip(growing, dw.grow_batch([(r, plan, commits[r]) for r in growing])):
            assert not isinstance(tree, Exception), tree
            commits[r] = []  # applied (also by a prefill chunk's call)
            if tree != NOT_YET:
                trees[r] = tree
        holding = [r for r in live if r in trees]
        for r, verdict in zip(holding, tw.verify_batch([(r, plan, trees[r]) for r in holding])):
            assert not isinstance(verdict, Exception), verdict
            if verdict != NOT_YET:
                del trees[r]
                commits[r] = [(verdict.path, verdict.tokens, length[r])]
                length[r] += len(verdict.tokens)
                out[r] += verdict.tokens
    for rid in ids:
        tw.finish(rid)
        dw.finish(rid)
    return [out[r][:p.max_tokens] for r, p in zip(ids, params)]


def _batched(pair, layout: str, dynamic: bool):
    """Three requests, one greedy and two sampled: ragged prompts (the longest prefilled in chunks of 4 beside
    the others' decoding, two sharing a cached prefix block of 8), a tree per request, adaptive or not."""
    from sequoia_ray.draft import DynamicTrees
    from sequoia_ray.prefix_cache import PrefixCache

    target, draft = pair
    rule = DynamicTrees(threshold=0.05, extend=2) if dynamic else None
    tw = TargetWorker(target, layout=layout, prefill_chunk=4, prefix_cache=PrefixCache(block=8, max_tokens=64))
    dw = DraftWorker(draft, layout=layout, prefill_chunk=4, dynamic=rule,
                     prefix_cache=PrefixCache(block=8, max_tokens=64))
    params = [SamplingParams(max_tokens=10, temperature=t) for t in (0.0, 0.8, 0.8)]
    _serve(tw, dw, PROMPTS[:1], specinfer(2, 2), params[:1])  # fills the prefix caches
    outputs = _serve(tw, dw, PROMPTS, specinfer(3, 3), params)
    assert tw.prefix_cache.reused == dw.prefix_cache.reused == 24  # the first prompt 2 blocks of 8, the second 1
    return outputs


@pytest.mark.parametrize("layout", ["flat", "padded", "ragged"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_batched_steps_stay_on_the_model_device(pair, monkeypatch, layout, dynamic):
    host = _batched(pair, layout, dynamic)
    monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
    levels, draw = [], DraftWorker._draw_children
    monkeypatch.setattr(DraftWorker, "_draw_children", lambda self, *args: levels.append(1) or draw(self, *args))
    with ClaimedAccelerator() as mode:
        claimed = _batched(pair, layout, dynamic)
    _clean(mode)
    # a static tree's children are written with one host-to-device index copy per level (one per node before)
    assert sum("(_draw_children)" in u for u in mode.uploads) <= len(levels)
    # Host reads (a sync each on an accelerator): none in the forwards, masks or KV compaction; the sampled
    # requests' supports at most once per tree level (specinfer(3, 3): 3 levels with children, 13 such nodes).
    assert not [r for r in mode.host_reads if r.startswith("sequoia_ray.models")], mode.host_reads
    trees = sum(r.startswith("sequoia_ray.draft") and r.endswith("(to): to") for r in mode.host_reads)
    assert 0 < sum("(truncate_rows)" in r for r in mode.host_reads) <= 3 * trees
    assert claimed == host and all(len(out) == 10 for out in host)  # the redirect changes nothing but placement


def test_a_batched_verify_reads_the_device_twice_whatever_its_requests(pair, monkeypatch):
    """Four requests in one verify, two greedy and two sampled: one read of the greedy walks' argmax ids and one of
    the sampled walks' rows for the whole batch (one per request before), and the verdicts of verifying alone."""
    target, draft = pair
    plan, prompts = specinfer(2, 2), [[3, 1, 4, 1], [5, 9, 2], [6, 5, 3, 5, 8], [9, 7]]
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i) for i, t in enumerate((0.0, 0.8, 0.0, 0.8))]

    def verdicts(claimed: bool):
        tw, dw = TargetWorker(target), DraftWorker(draft)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            tw.start(f"r{i}", prompt, p, seed=2 * i)
            dw.start(f"r{i}", prompt, p, seed=2 * i + 1)
        trees = dw.grow_batch([(f"r{i}", plan) for i in range(4)])
        if not claimed:
            return [tw.verify(f"r{i}", plan, tree) for i, tree in enumerate(trees)], []
        monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
        with ClaimedAccelerator() as mode:
            out = tw.verify_batch([(f"r{i}", plan, tree) for i, tree in enumerate(trees)])
        _clean(mode)
        return out, [r for r in mode.host_reads if r.startswith("sequoia_ray.verify")]

    alone, _ = verdicts(claimed=False)
    batched, reads = verdicts(claimed=True)
    assert batched == alone and len(reads) == 2, reads


def test_a_verify_places_each_tree_with_two_copies(pair, monkeypatch):
    """Each request's step reaches the device in two host-to-device copies (ids with positions, then the mask),
    whether or not committed tokens wait before its tree: one copy per piece was four waits a request, every step."""
    target, draft = pair
    plan, prompts = specinfer(2, 2), [[3, 1, 4, 1], [5, 9, 2], [6, 5, 3, 5, 8]]
    tw, dw = TargetWorker(target), DraftWorker(draft)
    for i, prompt in enumerate(prompts):
        tw.start(f"r{i}", prompt, SamplingParams(max_tokens=8), seed=i)
        dw.start(f"r{i}", prompt, SamplingParams(max_tokens=8), seed=i)
    monkeypatch.setattr(torch, "Generator", ClaimedGenerator)
    for step in range(2):  # the first step forwards each prompt before its tree, the second only the tree
        trees = dw.grow_batch([(f"r{i}", plan) for i in range(3)])
        with ClaimedAccelerator() as mode:
            verdicts = tw.verify_batch([(f"r{i}", plan, tree) for i, tree in enumerate(trees)])
        _clean(mode)
        assert not [v for v in verdicts if isinstance(v, Exception)], verdicts
        for i, v in enumerate(verdicts):
            dw.commit(f"r{i}", v.path, v.tokens)
        assert sum("sequoia_ray.target" in u for u in mode.uploads) == 2 * len(prompts), (step, mode.uploads)
