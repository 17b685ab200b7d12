"""The quantized engine: same results as transformers' forward on the same weights, and every
guarantee of the session on top of it (Replay equals Re-prefill, forks, exports, adapters)."""

from __future__ import annotations

import gc

import pytest
import torch

from kvmemory import InputError, KVSession, engine, kvcache, load_model
from kvmemory.engine.buffers import CacheBuffers
from kvmemory.engine.llama import DENSE_FROM_ROWS, EXACT_DENSE_FROM_ROWS
from kvmemory.engine.quantized import KernelUnavailableError, Q4Linear, Q8Linear, kernel
from kvmemory.errors import EngineUnsupportedError
from kvmemory.executors.packed import run_packed
from kvmemory.engine import forward_rows
from kvmemory.models import embedded_gguf_path
from support import QUERY, history, replaced, reprefill_logits, tiny_model, without

# fp32 with another summation order than transformers' GEMMs: measured 2e-5 .. 5e-5 on logits of
# magnitude ~20 (30 layers); a wrong row, position or weight moves logits by > 0.1.
LOGITS_ATOL = 1e-3
ROWS_ATOL = 1e-4


def _random_q4(rows: int, width: int, seed: int = 0) -> Q4Linear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, width // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows, width // 32, generator=g) * 0.02
    mins = -torch.rand(rows, width // 32, generator=g) * 0.1
    return Q4Linear(codes, scales, mins)


@pytest.mark.parametrize("rows,m", [(37, 1), (64, 3), (21, 13)])
def test_q4_kernel_equals_the_dequantized_product(rows, m):
    weight = _random_q4(rows, 96)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(weight(x), x @ weight.dequantize().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 10])
def test_q8_kernel_equals_the_dequantized_product(m):
    g = torch.Generator().manual_seed(2)
    weight = Q8Linear(torch.randint(-128, 128, (45, 64), generator=g, dtype=torch.int8), torch.rand(45, 2, generator=g))
    x = torch.randn(m, 64, generator=g)
    torch.testing.assert_close(weight(x), x @ weight.dequantize().T, atol=1e-4, rtol=1e-5)


def test_embedded_model_runs_on_its_gguf_blocks(real):
    assert real.engine == engine.EngineStatus("q4_1")
    assert engine.status(real.model).name == "q4_1"


def _prompt(real, n: int) -> torch.Tensor:
    text = " ".join(m["content"] for m in history()) * 4
    ids = real.tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n])


def test_prefill_append_and_decode_equal_transformers(real):
    ids = _prompt(real, 160)
    fast = kvcache.new_cache(real.model.config)
    assert isinstance(engine.engine_for(real.model, fast), engine.Engine)
    assert engine.engine_for(real.model, fast).kind == "q4_1"
    logits = [forward_rows(real.model, fast, ids[:120], 0), forward_rows(real.model, fast, ids[120:125], 120)]
    # a 3-row draft check: every row's logits
    logits += list(forward_rows(real.model, fast, ids[125:128], 125, every_row=True))
    logits += [forward_rows(real.model, fast, ids[i : i + 1], i) for i in range(128, 160)]
    # reference: transformers' own forward (no cache) at each position
    with torch.no_grad():
        ref = real.model(input_ids=ids[None]).logits[0].float()
    ends = [119, 124] + list(range(125, 160))
    for got, end in zip(logits, ends):
        torch.testing.assert_close(got, ref[end], atol=LOGITS_ATOL, rtol=0)
    plain = kvcache.new_cache(real.model.config)
    with torch.no_grad():
        real.model(input_ids=ids[None], cache=plain, use_cache=True)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(fast), kvcache.layer_tensors(plain)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)


def test_appends_below_the_dense_threshold_run_on_the_blocks_like_transformers(real, monkeypatch):
    """The exact engine computes appends of up to EXACT_DENSE_FROM_ROWS - 1 rows in one call on its
    blocks (faster than the dense GEMMs there) and longer ones densely: every row's logits and
    K/V equal transformers' (fp32 summation order)."""
    ids = _prompt(real, 100 + 40 + EXACT_DENSE_FROM_ROWS)
    fast = kvcache.new_cache(real.model.config)
    quantized = engine.engine_for(real.model, fast)
    decoder, calls = quantized.decoder, []

    class Counted:  # the engine's C++ decoder, counting the rows of each several-row call
        def rows(self, *args):
            calls.append(args[0].shape[0])
            return decoder.rows(*args)

        def step(self, *args):
            return decoder.step(*args)

    monkeypatch.setattr(quantized, "decoder", Counted())
    sizes = [100, 40, EXACT_DENSE_FROM_ROWS - 1, 1]
    logits, start = [], 0
    for n in sizes:
        logits.append(forward_rows(real.model, fast, ids[start:start + n], start, every_row=True))
        start += n
    assert calls == [40, EXACT_DENSE_FROM_ROWS - 1]  # the prefill of 100 rows ran densely
    with torch.no_grad():
        ref = real.model(input_ids=ids[None, :start]).logits[0].float()
    torch.testing.assert_close(torch.cat(logits), ref, atol=LOGITS_ATOL, rtol=0)
    plain = kvcache.new_cache(real.model.config)
    with torch.no_grad():
        real.model(input_ids=ids[None, :start], cache=plain, use_cache=True)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(fast), kvcache.layer_tensors(plain)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)


def test_greedy_answers_equal_the_transformers_engine(real):
    messages = history()
    fast = KVSession(real.model, real.tokenizer)
    fast.prepare(messages)
    fast_answer = fast.generate(24).token_ids
    engine.attach(real.model, embedded_gguf_path(), "transformers")
    try:
        slow = KVSession(real.model, real.tokenizer)
        report = slow.prepare(messages)
        assert report.engine == {"name": "transformers", "reason": None, "isa": None}
        assert slow.generate(24).token_ids == fast_answer
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")


def test_replay_after_a_deletion_on_engine_rows_equals_reprefill(real):
    session = KVSession(real.model, real.tokenizer, policy="replay")
    session.prepare(history() + [QUERY])
    session.generate(12)
    report = session.prepare(without(history() + [QUERY], "t1"))
    assert report.engine["name"] == "q4_1"
    torch.testing.assert_close(session.next_logits, reprefill_logits(real.model, session.token_ids), atol=LOGITS_ATOL, rtol=0)
    session.check_invariants()


def test_forks_and_exports_do_not_share_engine_buffers(real):
    session = KVSession(real.model, real.tokenizer)
    session.prepare(history())
    session.generate(4)
    other = session.fork()
    rows = len(other.token_ids)
    before = [k.clone() for k, _ in kvcache.layer_tensors(other.cache)]
    session.generate(6)  # writes rows after the fork's last row into the session's own buffer
    for k, (k2, _) in zip(before, kvcache.layer_tensors(other.cache)):
        assert torch.equal(k, k2)
    assert other.generate(6).token_ids == session.token_ids[rows : rows + 6]


def test_a_replaced_layer_gets_a_fresh_buffer():
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache = kvcache.from_tensors([(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))])
    storage = buffers.reserve(cache, 3, 1)
    buffers.publish(cache, storage, 4)
    kept = cache.layers[0].keys
    layer = cache.layers[0]
    layer.keys, layer.values = layer.keys[:, :, :2].clone(), layer.values[:, :, :2].clone()  # another writer
    again = buffers.reserve(cache, 2, 1)
    assert again.all_keys.data_ptr() != storage.all_keys.data_ptr()
    again.all_keys[0, :, :, 2] = 7.0
    assert not (kept == 7.0).any()
    with pytest.raises(ValueError, match="holds 2 rows"):
        buffers.reserve(cache, 5, 1)


def test_a_cropped_cache_keeps_its_buffer_and_loses_the_cropped_rows():
    """A crop of the published views (the last answer's rows dropped before the next turn) is
    taken back in place: no copy of the kept rows, the cropped rows zeroed, the capacity kept."""
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache = kvcache.from_tensors([(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))])
    storage = buffers.reserve(cache, 3, 1, capacity=12)
    storage.all_keys[0, :, :, 3:9] = 5.0
    buffers.publish(cache, storage, 9)
    cache.crop(-4)
    again = buffers.reserve(cache, 5, 1)
    assert again is storage and again.capacity == 12
    assert (again.all_keys[0, :, :, :3] == 1.0).all() and (again.all_keys[0, :, :, 3:5] == 5.0).all()
    assert (again.all_keys[0, :, :, 5:] == 0).all() and (again.all_values[0, :, :, 5:] == 0).all()
    buffers.publish(cache, again, 6)
    assert cache.get_seq_length() == 6 and cache.layers[0].keys.data_ptr() == storage.all_keys.data_ptr()


def _dropped_buffer(buffers: CacheBuffers, rows: int, capacity: int) -> tuple[int, torch.Tensor]:
    """The address of a buffer of ``capacity`` rows whose cache (``rows`` rows of 3.0) was dropped,
    and a view a caller kept of its first layer's keys."""
    cache = kvcache.from_tensors([(torch.full((1, 2, rows, 4), 3.0), torch.full((1, 2, rows, 4), 3.0))])
    storage = buffers.reserve(cache, rows, 1, capacity=capacity)
    buffers.publish(cache, storage, rows)
    address, view = storage.all_keys.data_ptr(), cache.layers[0].keys
    del cache, storage
    gc.collect()
    return address, view


def test_a_dropped_cache_lends_its_memory_to_the_next_one_with_every_row_rewritten():
    """Memory of a dropped cache serves the next buffer of about its size (no fresh pages to fault
    in), once nothing views it: its rows are the new cache's, the spare rows zero."""
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    address, view = _dropped_buffer(buffers, rows=5, capacity=8)
    fresh = kvcache.from_tensors([(torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))])
    viewed = buffers.reserve(fresh, 4, 1, capacity=7)  # a caller still holds a view: not reused
    assert viewed.all_keys.data_ptr() != address and (view == 3.0).all()
    del view
    gc.collect()
    cache = kvcache.from_tensors([(torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))])
    again = buffers.reserve(cache, 4, 1, capacity=7)
    assert again.all_keys.data_ptr() == address
    for tensor in (again.all_keys, again.all_values):
        assert (tensor[0, :, :, :4] == 1.0).all() and (tensor[0, :, :, 4:] == 0).all()


def test_a_large_dropped_buffer_is_not_pinned_by_a_small_cache():
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    address, view = _dropped_buffer(buffers, rows=5, capacity=40)
    del view
    cache = kvcache.from_tensors([(torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))])
    assert buffers.reserve(cache, 4, 1, capacity=8).all_keys.data_ptr() != address


def _repaired_twice(real) -> tuple[KVSession, int]:
    """A session after two replacement repairs, and the address of its first cache's memory."""
    gc.collect()  # earlier tests' caches released now, not between the repairs
    session = KVSession(real.model, real.tokenizer, policy="sur@5")
    messages = history() + [QUERY]
    session.prepare(messages)
    first = kvcache.layer_tensors(session.cache)[0][0].data_ptr()
    session.prepare(replaced(messages, "t2", "Port Calder has two lighthouses. The older one is a museum now."))
    session.prepare(replaced(messages, "t2", "Port Calder has four lighthouses. The oldest dates from 1790."))
    return session, first


def test_repeated_repairs_reuse_the_replaced_cache_memory(real, monkeypatch):
    """Each repair gathers the kept rows into a new buffer while the old cache is still read; from
    the second one on, that buffer is the memory of the cache the previous repair replaced. The
    repaired rows and answer are exactly those of fresh memory."""
    session, first = _repaired_twice(real)
    assert kvcache.layer_tensors(session.cache)[0][0].data_ptr() == first
    monkeypatch.setattr(CacheBuffers, "_take_spare", lambda self, numel: None)
    fresh, _ = _repaired_twice(real)
    assert torch.equal(session.next_logits, fresh.next_logits)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(fresh.cache)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    session.check_invariants()


def test_modified_weights_and_adapters_fall_back_to_transformers():
    loaded = load_model(keep_dense=True)  # weights edited in place below
    model = loaded.model
    ids = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.01)
    status = engine.status(model)
    assert status.name == "transformers" and "modified in place" in status.reason
    cache = kvcache.new_cache(model.config)
    assert engine.engine_for(model, cache).kind == "transformers"
    torch.testing.assert_close(forward_rows(model, cache, ids, 0), reprefill_logits(model, ids), atol=1e-4, rtol=0)
    with pytest.raises(EngineUnsupportedError, match="not the GGUF file's blocks"):
        engine.attach(model, embedded_gguf_path(), "q4_1")


def test_a_lora_adapter_runs_on_transformers(real):
    peft = pytest.importorskip("peft")
    loaded = load_model()
    model = peft.get_peft_model(loaded.model, peft.LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    status = engine.status(loaded.model)
    assert status.name == "transformers" and "LoRA" in status.reason
    session = KVSession(model, loaded.tokenizer)
    report = session.prepare(history()[:2])
    assert report.engine["name"] == "transformers"
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=1e-4, rtol=0)


def test_bad_engine_requests_say_why():
    with pytest.raises(InputError, match="engine must be one of"):
        load_model(engine="fast")
    tiny = tiny_model("llama")
    with pytest.raises(EngineUnsupportedError, match="no GGUF file"):
        engine.attach(tiny, "/nonexistent.gguf", "q4_1")
    assert engine.attach(tiny, embedded_gguf_path(), "auto").name == "transformers"
    assert "not the GGUF file's blocks" in engine.status(tiny).reason or "shape" in engine.status(tiny).reason


# ---- engine "q4_1_int8": int8 activations on the block path (lossy by design, like llama.cpp) ----

def _needs_vnni() -> None:
    """The int8 kernels exist only in a VNNI build (AVX-512 VNNI CPUs): skip their tests elsewhere
    (what such a machine does instead is checked by the attach test below)."""
    if not kernel().has_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI, which this CPU lacks")


def test_int8_engine_attaches_only_where_the_cpu_has_vnni(real):
    """With VNNI the int8 engine attaches; without it, attaching fails naming the exact engine and
    the model keeps the engine it had."""
    if kernel().has_vnni():
        try:
            assert engine.attach(real.model, embedded_gguf_path(), "q4_1_int8") == engine.EngineStatus("q4_1_int8")
        finally:
            engine.attach(real.model, embedded_gguf_path(), "q4_1")
        return
    before = engine.status(real.model)
    with pytest.raises(KernelUnavailableError, match="engine='q4_1'"):
        engine.attach(real.model, embedded_gguf_path(), "q4_1_int8")
    assert engine.status(real.model) == before and before.name != "q4_1_int8"


def _rounded_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: each 32-value block rounded to e * int8, e = max|x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    e = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(e > 0, 1 / e, torch.zeros_like(e))
    return ((blocks * inv).round() * e).view_as(x)


def _int8_error_bound(x: torch.Tensor, codes_only: torch.Tensor) -> torch.Tensor:
    """|y_int8 - y_fp32| <= sum over blocks of e/2 * sum_j |d q_j| (each value moves by at most
    half a step; the Q4_1 min term is exact). ``codes_only``: the weight without its mins."""
    blocks = x.view(x.shape[0], -1, 32)
    half_step = blocks.abs().amax(-1) / 254  # [M, blocks]
    magnitude = codes_only.abs().view(codes_only.shape[0], -1, 32).sum(-1)  # [N, blocks]
    return half_step @ magnitude.T


@pytest.mark.parametrize("rows,width,m", [(37, 96, 1), (64, 576, 1), (21, 64, 3), (130, 160, 9), (9, 1536, 2)])
def test_q4_int8_kernel_is_the_product_of_the_rounded_activations(rows, width, m):
    _needs_vnni()
    weight = _random_q4(rows, width, seed=rows)
    x = torch.randn(m, width, generator=torch.Generator().manual_seed(m)) * 3
    codes_only = Q4Linear(weight.codes, weight.scales, torch.zeros_like(weight.mins)).dequantize()
    got = weight(x, int8=True)
    # exactly (fp32 order) the rounded activations times the codes, plus the exact min term
    expected = _rounded_blocks(x) @ codes_only.T + x.view(m, -1, 32).sum(-1) @ weight.mins.T
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and within the rounding bound of the exact fp32 product (which it is not equal to)
    error = (got - x @ weight.dequantize().T).abs()
    assert (error <= _int8_error_bound(x, codes_only) + 1e-5).all()
    assert error.max() > 1e-4


@pytest.mark.parametrize("width,m", [(64, 1), (96, 2), (576, 1)])
def test_q8_int8_kernel_is_the_product_of_the_rounded_activations(width, m):
    _needs_vnni()
    g = torch.Generator().manual_seed(width)
    weight = Q8Linear(torch.randint(-128, 128, (70, width), generator=g, dtype=torch.int8), torch.rand(70, width // 32, generator=g))
    x = torch.randn(m, width, generator=g)
    dense = weight.dequantize()
    got = weight(x, int8=True)
    # against the exact product of the rounded activations, relative to the largest product (fp32
    # sums over terms ~100x the results: measured <= 1.2e-7; a wrong code or block moves it > 1e-3)
    exact = (_rounded_blocks(x).double() @ dense.double().T).float()
    torch.testing.assert_close(got, exact, atol=1e-6 * exact.abs().max().item(), rtol=0)
    assert ((got - x @ dense.T).abs() <= _int8_error_bound(x, dense) + 1e-4).all()


@pytest.fixture
def int8_engine(real):
    """The real model on engine "q4_1_int8" for one test (the exact engine is restored after)."""
    _needs_vnni()
    status = engine.attach(real.model, embedded_gguf_path(), "q4_1_int8")
    assert status == engine.EngineStatus("q4_1_int8")
    try:
        yield real
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")


def _same_path_reprefill(model, token_ids) -> torch.Tensor:
    """Re-prefill through the model's current engine: every row from 0 in one call."""
    return forward_rows(model, kvcache.new_cache(model.config), torch.tensor(list(token_ids)), 0)


# int8 activations move SmolLM2's logits (magnitude ~20) by up to ~2 after 30 layers (measured
# 1.8 over 40 decoded tokens); a wrong row, position or weight moves them by far more.
INT8_LOGITS_ATOL = 3.0


def test_int8_engine_decodes_close_to_the_exact_engine(int8_engine):
    real = int8_engine
    ids = _prompt(real, 200)
    fast = kvcache.new_cache(real.model.config)
    got = [forward_rows(real.model, fast, ids[:150], 0), forward_rows(real.model, fast, ids[150:160], 150)]
    got += [forward_rows(real.model, fast, ids[i : i + 1], i) for i in range(160, 200)]
    with torch.no_grad():
        ref = real.model(input_ids=ids[None]).logits[0].float()  # the fp32 weights, exact activations
    for logits, end in zip(got, [149, 159] + list(range(160, 200))):
        torch.testing.assert_close(logits, ref[end], atol=INT8_LOGITS_ATOL, rtol=0)
    assert max((g - ref[e]).abs().max().item() for g, e in zip(got, [149, 159] + list(range(160, 200)))) > 1e-2


@pytest.mark.parametrize("deleted", ["t1", "t3"])
def test_replay_on_the_int8_engine_equals_its_own_reprefill(int8_engine, deleted):
    """Replay recomputes every row after the edit through the same engine as a Re-prefill: the
    long suffix (t1) on the exact dense path like Re-prefill's prompt (equal to fp32 order), the
    short one (t3: fewer rows than the dense threshold) with int8 activations (INT8_LOGITS_ATOL)."""
    real = int8_engine
    session = KVSession(real.model, real.tokenizer, policy="replay")
    session.prepare(history() + [QUERY])
    session.generate(12)
    report = session.prepare(without(history() + [QUERY], deleted))
    assert report.engine["name"] == "q4_1_int8"
    reference = _same_path_reprefill(real.model, session.token_ids)
    dense = report.recomputed_tokens >= DENSE_FROM_ROWS
    assert dense == (deleted == "t1")  # t3's 21 rows take the int8 block path
    tolerance = LOGITS_ATOL if dense else INT8_LOGITS_ATOL
    torch.testing.assert_close(session.next_logits, reference, atol=tolerance, rtol=0)
    assert session.next_logits.argmax() == reference.argmax()
    session.check_invariants()


GREEDY_PROMPTS = [
    history(), history() + [QUERY], history()[:2], without(history() + [QUERY], "t1"),
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a cache is to a child."}],
]


def _common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_int8_greedy_answers_mostly_equal_the_exact_engine(real):
    """Measured: 4 of 8 answers (24 tokens) identical on one AVX-512 VNNI machine, none on
    another (equal leading tokens 5, 3, 9, 4, 1, 7, 10, 7: a near-tie flipped by the rounding,
    as between llama.cpp and transformers; which ones flip moves with the machine and fp32
    summation order). So the bounds are the first token of most answers and the mean equal
    prefix, with a margin. A broken kernel agrees on none."""
    _needs_vnni()

    def answers():
        out = []
        for messages in GREEDY_PROMPTS:
            session = KVSession(real.model, real.tokenizer)
            session.prepare(messages)
            out.append(session.generate(24).token_ids)
        return out

    exact = answers()
    engine.attach(real.model, embedded_gguf_path(), "q4_1_int8")
    try:
        fast = answers()
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")
    prefixes = [_common_prefix(a, b) for a, b in zip(exact, fast)]
    assert sum(n >= 1 for n in prefixes) >= 6, prefixes
    assert sum(prefixes) / len(prefixes) >= 3, prefixes


def test_int8_engine_is_reported_and_requested_by_name():
    with pytest.raises(InputError, match="q4_1_int8"):
        load_model(engine="int8")
    tiny = tiny_model("llama")
    with pytest.raises(EngineUnsupportedError):
        engine.attach(tiny, embedded_gguf_path(), "q4_1_int8")


# bf16 weights and activations in the prefill's GEMMs move SmolLM2's logits by ~0.4 (measured
# 0.25 .. 0.40 against the fp32 forward, as transformers' own bf16 dtype does).
BF16_LOGITS_ATOL = 1.5


@pytest.mark.parametrize("kind", ["q4_1_bf16", "q4_1_int8_bf16"])
def test_bf16_prefill_engine_replays_like_its_own_reprefill(real, kind):
    if "int8" in kind:
        _needs_vnni()
    status = engine.attach(real.model, embedded_gguf_path(), kind)
    try:
        assert status == engine.EngineStatus(kind)
        fast = engine.engine_for(real.model, kvcache.new_cache(real.model.config))
        copies = sum(p.numel() for layer in real.model.model.layers for p in layer.parameters() if p.dim() == 2) * 2
        assert fast.nbytes > copies  # the bf16 weight copies are counted
        session = KVSession(real.model, real.tokenizer, policy="replay")
        session.prepare(history() + [QUERY])
        session.generate(12)
        report = session.prepare(without(history() + [QUERY], "t1"))
        assert report.engine["name"] == kind and report.recomputed_tokens >= DENSE_FROM_ROWS
        reference = _same_path_reprefill(real.model, session.token_ids)
        torch.testing.assert_close(session.next_logits, reference, atol=LOGITS_ATOL, rtol=0)
        exact = reprefill_logits(real.model, session.token_ids)
        torch.testing.assert_close(reference, exact, atol=BF16_LOGITS_ATOL, rtol=0)
        assert (reference - exact).abs().max() > 1e-2  # it did run in bf16
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")


def test_an_appended_turn_reserves_the_last_answer_room():
    """An appended turn (no capacity given) grows the buffer by the answer room the caller reserved
    for the last answer, so the answer that follows fits without a second copy of every row."""
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache = kvcache.from_tensors([(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))])
    storage = buffers.reserve(cache, 3, 1, capacity=3 + 6)  # an answer of up to 6 rows
    for length in range(4, 6):
        buffers.publish(cache, storage, length)
        storage = buffers.reserve(cache, length, 1, capacity=9)
    buffers.publish(cache, storage, 6)
    turn = buffers.reserve(cache, 6, 5)  # an appended turn of 5 rows
    assert turn is not storage and turn.capacity == 6 + 5 + 6
    buffers.publish(cache, turn, 11)
    assert buffers.reserve(cache, 11, 1, capacity=11 + 6) is turn


def test_gathered_rows_land_in_an_engine_buffer_with_the_same_rows(real):
    """A repair's Shift gathers the kept rows into the engine's storage (runs of rows copied as
    slices, placeholders zero): the same rows as kvcache's gather, and the answer after the
    repair appends into that storage without another copy."""
    session = KVSession(real.model, real.tokenizer)
    session.prepare(history())
    session.generate(4)
    n = len(session.token_ids)
    rows = torch.cat([torch.arange(0, 10), torch.full((3,), -1), torch.arange(20, n)])
    expected = kvcache.gather_rows(session.cache, rows)
    gathered = engine.engine_for(real.model, session.cache).gather_rows(session.cache, rows)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(expected), kvcache.layer_tensors(gathered)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    storage = engine.engine_for(real.model, gathered).buffers.reserve(gathered, rows.shape[0], 1)
    assert kvcache.layer_tensors(gathered)[0][0].data_ptr() == storage.all_keys.data_ptr()


def test_a_deletion_repair_hands_its_rows_to_the_next_answer_without_a_copy(real):
    session = KVSession(real.model, real.tokenizer, policy="sur@5")
    session.prepare(history() + [QUERY])
    session.generate(8)
    session.prepare(without(history() + [QUERY], "t1"))
    repaired = kvcache.layer_tensors(session.cache)[0][0].data_ptr()
    session.generate(3)
    assert kvcache.layer_tensors(session.cache)[0][0].data_ptr() == repaired
    session.check_invariants()


def test_a_short_packed_refresh_runs_on_the_blocks_like_the_dense_weights(real):
    """A refresh of fewer than the engine's dense_from_rows rows multiplies on its blocks (bytes
    bound it): the same rows and logits as the model's dense modules up to fp32 summation order."""
    session = KVSession(real.model, real.tokenizer)
    session.prepare(history() + [QUERY])
    ids = torch.tensor(session.token_ids)
    positions = [5, 6, 7, 40, 41, 90, len(session.token_ids) - 1]
    dense_from = engine.engine_for(real.model, session.cache).dense_from_rows
    assert dense_from == EXACT_DENSE_FROM_ROWS  # the exact engine: blocks up to 95 rows, then dense GEMMs
    assert engine.engine_for(real.model, session.cache).block_linears(dense_from - 1) is not None
    assert engine.engine_for(real.model, session.cache).block_linears(dense_from) is None
    on_blocks, fast = run_packed(real.model, session.cache, ids, positions)
    engine.attach(real.model, embedded_gguf_path(), "transformers")
    try:
        dense, slow = run_packed(real.model, session.cache, ids, positions)
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")
    torch.testing.assert_close(fast.next_logits, slow.next_logits, atol=LOGITS_ATOL, rtol=0)
    assert not torch.equal(fast.next_logits, slow.next_logits)  # another code path did run
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(on_blocks), kvcache.layer_tensors(dense)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)


@pytest.mark.parametrize("count", [3, 14, 23, 60])
def test_a_packed_refresh_of_engine_rows_is_one_engine_call_with_the_same_rows(real, monkeypatch, count):
    """After a deletion the repair's cache lives in the engine's storage: a short packed refresh
    then runs every layer in one engine call (rows scattered over the cache, each attending its
    causal prefix, one pass per row over the cached rows for each key/value group's heads).
    Same rows and logits as the layer-by-layer packed executor on the same blocks."""
    session = KVSession(real.model, real.tokenizer)
    session.prepare(history() + [QUERY])
    n = len(session.token_ids)
    kept = torch.cat([torch.arange(0, 30), torch.arange(60, n)])  # rows 30..59 deleted
    ids = torch.tensor(session.token_ids)[kept]
    g = torch.Generator().manual_seed(count)
    positions = torch.cat([torch.sort(30 + torch.randperm(len(kept) - 31, generator=g)[: count - 1]).values,
                           torch.tensor([len(kept) - 1])])
    calls = []
    original = type(engine.engine_for(real.model, session.cache)).refresh_rows
    monkeypatch.setattr(type(engine.engine_for(real.model, session.cache)), "refresh_rows",
                        lambda self, *a: calls.append(original(self, *a)) or calls[-1])
    in_engine = engine.engine_for(real.model, session.cache).gather_rows(session.cache, kept)
    copied = kvcache.from_tensors(kvcache.layer_tensors(in_engine))
    _, fast = run_packed(real.model, in_engine, ids, positions, in_place=True)
    assert len(calls) == 1 and calls[0] is not None  # the engine ran it
    _, slow = run_packed(real.model, copied, ids, positions, in_place=True)
    assert len(calls) == 2 and calls[1] is None  # not its storage: the layer-by-layer executor
    torch.testing.assert_close(fast.next_logits, slow.next_logits, atol=LOGITS_ATOL, rtol=0)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(in_engine), kvcache.layer_tensors(copied)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)
    unchanged = torch.ones(len(kept), dtype=torch.bool)
    unchanged[positions] = False
    before = kvcache.layer_tensors(engine.engine_for(real.model, session.cache).gather_rows(session.cache, kept))
    for (k, _), (k2, _) in zip(kvcache.layer_tensors(in_engine), before):
        assert torch.equal(k[:, :, unchanged], k2[:, :, unchanged]) and not torch.equal(k, k2)


def _thp_eligible(address: int) -> bool | None:
    """smaps' THPeligible flag of the mapping holding ``address`` (None: not readable here)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_engine_buffers_ask_for_huge_pages_without_changing_their_rows():
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this system")
    if "[madvise]" not in mode:
        pytest.skip(f"transparent huge pages are not in madvise mode here ({mode.strip()})")
    buffers = CacheBuffers(kv_heads=3, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    storage = buffers._empty(layers=30, capacity=2048)  # 47 MB per tensor, as a 2 K cache of SmolLM2
    middle = storage.all_keys.data_ptr() + storage.all_keys.numel() * 2  # half way in (4-byte floats)
    assert _thp_eligible(middle) is True
    small = torch.empty(1000)
    engine.buffers.huge_pages(small)  # too small to hold a 2 MB page: left alone
    storage.all_keys.fill_(1.5)
    assert bool((storage.all_keys == 1.5).all())
