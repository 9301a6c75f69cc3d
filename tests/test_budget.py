"""The memory planner on literal model facts."""

import pytest

from edgespec.budget import GiB, Budget, ModelMemory, parse_size, plan
from edgespec.errors import InvalidRequestError, OutOfMemoryError

# Qwen2.5-Coder-1.5B / 0.5B Q4_K_M, as their GGUF metadata states.
QWEN_15B = ModelMemory("qwen-1.5b", weights_bytes=1_111_370_240, n_layer=28, n_head_kv=2, head_dim_k=128,
                       head_dim_v=128, n_vocab=151_936, n_embd=1536, n_ff=8960, n_ctx_train=32768)
QWEN_05B = ModelMemory("qwen-0.5b", weights_bytes=485_000_000, n_layer=24, n_head_kv=2, head_dim_k=64,
                       head_dim_v=64, n_vocab=151_936, n_embd=896, n_ff=4864, n_ctx_train=32768)
CPU_24G = Budget("cpu", ram_bytes=24 * GiB)


def test_kv_bytes_per_token_at_f16():
    # 28 layers x 2 KV heads x 128 head dim x 2 (K and V) x 2 bytes
    assert QWEN_15B.kv_bytes_per_token("f16") == 28 * 2 * 128 * 2 * 2 == 28_672
    assert QWEN_15B.kv_bytes_per_token("q8_0") == int(28 * 2 * 256 * 34 / 32)


def test_roomy_machine_keeps_everything():
    p = plan(QWEN_15B, QWEN_05B, CPU_24G, n_ctx=4096, k_max=15)
    assert (p.n_ctx, p.k_max, p.load_draft, p.target_gpu_layers, p.draft_gpu_layers) == (4096, 15, True, 0, 0)
    kv = dict(p.rows)["qwen-1.5b KV cache (4096 tokens, f16)"]
    assert kv == 28_672 * 4096
    assert dict(p.rows)["qwen-1.5b logits (16 rows)"] == 16 * 151_936 * 4
    assert not p.notes


def test_budget_too_small_for_the_draft_drops_it_and_says_so():
    target_only = plan(QWEN_15B, None, CPU_24G, n_ctx=4096).total_bytes
    p = plan(QWEN_15B, QWEN_05B, Budget("cpu", int(target_only / 0.9) + 10 * 2**20), n_ctx=4096)
    assert not p.load_draft and p.n_ctx == 4096
    assert any("qwen-0.5b not loaded" in n for n in p.notes)
    assert all("qwen-0.5b" not in item for item, _ in p.rows)


def test_context_shrinks_before_the_target_is_refused():
    fixed = plan(QWEN_15B, None, CPU_24G, n_ctx=256).total_bytes - 28_672 * 256
    budget = Budget("cpu", int((fixed + 28_672 * 1000) / 0.9))
    p = plan(QWEN_15B, None, budget, n_ctx=4096)
    assert 990 <= p.n_ctx <= 1000
    assert "context reduced from 4096" in p.notes[0]


def test_budget_too_small_for_the_target_fails_with_the_numbers():
    with pytest.raises(OutOfMemoryError) as e:
        plan(QWEN_15B, QWEN_05B, Budget("cpu", 1 * GiB), n_ctx=4096)
    msg = str(e.value)
    assert "qwen-1.5b needs at least 1.4" in msg and "0.90 GiB" in msg and "missing" in msg
    assert "smaller quantization" in msg


def test_small_gpu_puts_the_draft_on_the_cpu():
    need_target = plan(QWEN_15B, None, CPU_24G, n_ctx=4096).total_bytes
    p = plan(QWEN_15B, QWEN_05B, Budget("cuda", 16 * GiB, int(need_target / 0.9) + 2**20), n_ctx=4096)
    assert p.load_draft and p.target_gpu_layers == 28 and p.draft_gpu_layers == 0
    assert "runs on the CPU" in p.notes[0]


@pytest.mark.parametrize("text, value", [("6GiB", 6 * GiB), ("6 GB", 6_000_000_000), ("512MiB", 512 * 2**20),
                                         ("1.5g", 1_500_000_000), ("1024", 1024)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_refuses_nonsense():
    with pytest.raises(InvalidRequestError, match="6GiB"):
        parse_size("six gigs")


def test_kmax_fits_one_batch_and_the_memory_left():
    assert plan(QWEN_15B, None, CPU_24G, n_ctx=4096).k_max == 63
    p = plan(QWEN_15B, None, CPU_24G, n_ctx=4096, k_max=63, n_ubatch=32)
    assert p.k_max == 31 and "a verify batch must fit one batch of 32" in p.notes[0]
    # room for the target at the smallest context and 9 logits rows (0.58 MiB each): Kmax 8, not 63
    need = plan(QWEN_15B, None, CPU_24G, n_ctx=256, k_max=0).total_bytes
    p = plan(QWEN_15B, None, Budget("cpu", int((need + 8 * 151_936 * 4 + 1000) / 0.9)), n_ctx=256)
    assert p.k_max == 8 and dict(p.rows)["qwen-1.5b logits (9 rows)"] == 9 * 151_936 * 4
    assert "Kmax lowered from 63 to 8" in p.notes[0]


def test_each_slot_holds_a_whole_context():
    one, two = plan(QWEN_15B, QWEN_05B, CPU_24G, n_ctx=4096), plan(QWEN_15B, QWEN_05B, CPU_24G, n_ctx=4096, n_seq=2)
    kv = lambda p: [b for item, b in p.rows if "KV cache" in item]  # noqa: E731
    assert kv(two) == [2 * b for b in kv(one)] and "x 2 slots" in two.rows[1][0]
    fixed = plan(QWEN_15B, None, CPU_24G, n_ctx=256).total_bytes - 28_672 * 256
    tight = Budget("cpu", int((fixed + 28_672 * 4096) / 0.9))  # room for one 4096-token context
    p = plan(QWEN_15B, None, tight, n_ctx=4096, n_seq=2)
    assert 2040 <= p.n_ctx <= 2048 and "(2 slots of it)" in p.notes[0]
