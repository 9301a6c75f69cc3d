"""The memory planner on literal model facts: what fits, and which layout of the layers it takes."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from edgespec.planning import budget as budget_module
from edgespec.planning.budget import GiB, Budget, ModelMemory, gpu_kind, idle_gpu_note, parse_size, plan
from edgespec.errors import InvalidRequestError, OutOfMemoryError
from edgespec.planning.placement import gpu_bandwidth

# Qwen2.5-Coder-1.5B / 0.5B Q4_K_M, as their GGUF metadata states.
QWEN_15B = ModelMemory("qwen-1.5b", weights_bytes=1_111_370_240, n_layer=28, n_head_kv=2, head_dim_k=128,
                       head_dim_v=128, n_vocab=151_936, n_embd=1536, n_ff=8960, n_ctx_train=32768)
QWEN_05B = ModelMemory("qwen-0.5b", weights_bytes=485_000_000, n_layer=24, n_head_kv=2, head_dim_k=64,
                       head_dim_v=64, n_vocab=151_936, n_embd=896, n_ff=4864, n_ctx_train=32768)
# Qwen2.5-Coder-7B-Instruct Q4_K_M: the Hub lists the file at 4.68 GB; shapes from its config.json.
QWEN_7B = ModelMemory("qwen-7b", weights_bytes=4_680_000_000, n_layer=28, n_head_kv=4, head_dim_k=128,
                      head_dim_v=128, n_vocab=152_064, n_embd=3584, n_ff=18944, n_ctx_train=32768)
CPU_24G = Budget("cpu", ram_bytes=24 * GiB)
# Free memory as a user would see it: the desktop holds a little of each GPU; Metal's limit is 2/3 of 16 GiB.
LAPTOP_4G = Budget("cuda", 12 * GiB, int(3.7 * GiB), gpu_name="NVIDIA GeForce RTX 3050 Laptop GPU")
DESKTOP_8G = Budget("cuda", 24 * GiB, int(7.5 * GiB), gpu_name="NVIDIA GeForce RTX 4060")
GPU_24G = Budget("cuda", 48 * GiB, 23 * GiB, gpu_name="NVIDIA GeForce RTX 4090")
APPLE_16G = Budget("metal", 12 * GiB, int(16 * GiB * 2 / 3), gpu_name="Apple M2")


def test_kv_bytes_per_token_at_f16():
    # 28 layers x 2 KV heads x 128 head dim x 2 (K and V) x 2 bytes
    assert QWEN_15B.kv_bytes_per_token("f16") == 28 * 2 * 128 * 2 * 2 == 28_672
    assert QWEN_15B.kv_bytes_per_token("q8_0") == int(28 * 2 * 256 * 34 / 32)


def test_roomy_machine_keeps_everything():
    p = plan(QWEN_15B, QWEN_05B, CPU_24G, n_ctx=4096, k_max=15, draft_gpu_layers=0)  # the draft asked for
    assert (p.n_ctx, p.k_max, p.load_draft, p.target_gpu_layers, p.draft_gpu_layers) == (4096, 15, True, 0, 0)
    kv = dict(p.rows)["qwen-1.5b KV cache (4096 tokens, f16)"]
    assert kv == 28_672 * 4096
    assert dict(p.rows)["qwen-1.5b logits (16 rows)"] == 16 * 151_936 * 4
    assert not p.notes


def test_budget_too_small_for_the_draft_drops_it_and_says_so():
    target_only = plan(QWEN_15B, None, CPU_24G, n_ctx=4096).total_bytes
    p = plan(QWEN_15B, QWEN_05B, Budget("cpu", int(target_only / 0.9) + 10 * 2**20), n_ctx=4096, accept=1.0)
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


def test_small_gpu_puts_the_draft_on_the_cpu_when_asked_to():
    need_target = plan(QWEN_15B, None, CPU_24G, n_ctx=4096).total_bytes
    p = plan(QWEN_15B, QWEN_05B, Budget("cuda", 16 * GiB, int(need_target / 0.9) + 2**20), n_ctx=4096,
             draft_gpu_layers=0)
    assert p.load_draft and p.target_gpu_layers == 29 and p.draft_gpu_layers == 0
    assert "runs on the CPU" in p.notes[0]


def _chosen(p):
    return p.chosen.description, p.load_draft


# The 1.5B target decodes at ~1.4 GiB: its 0.5B draft costs 0.4-0.7 of a target pass on any GPU (launch
# overhead per layer), so it cannot win 10% at the expected acceptance; the plan says so and drops it.
@pytest.mark.parametrize("budget", [LAPTOP_4G, DESKTOP_8G, GPU_24G, APPLE_16G], ids=["4G", "8G", "24G", "M2-16G"])
def test_the_small_pair_fits_every_gpu_and_its_draft_is_dropped_with_a_note(budget):
    p = plan(QWEN_15B, QWEN_05B, budget)
    assert _chosen(p) == ("target on the GPU, no draft, context 4096", False)
    assert {o.description for o in p.options} >= {"target on the GPU, draft on the GPU, context 4096",
                                                   "target on the GPU, draft on the CPU, context 4096"}
    note = next(n for n in p.notes if "qwen-0.5b not loaded" in n)
    assert "the best layout with it (target on the GPU, draft on the GPU, context 4096)" in note and "10%" in note
    assert p.target_gpu_layers == QWEN_15B.n_layer + 1  # the output layer too


def test_the_small_pair_on_a_cpu_drops_the_draft():
    p = plan(QWEN_15B, QWEN_05B, CPU_24G)
    assert _chosen(p) == ("target on the CPU, no draft, context 4096", False)
    assert [o.k for o in p.options if o.layout.draft_gpu_layers is not None] == [0]  # no K pays on this curve


def test_7b_on_a_4gib_laptop_splits_the_target_and_drafts_from_the_cpu():
    p = plan(QWEN_7B, QWEN_05B, LAPTOP_4G)
    assert not p.chosen.layout.target_gpu_layers in (0, 29) and p.n_ctx == 4096
    assert p.load_draft and p.draft_gpu_layers == 0 and "runs on the CPU" in p.notes[0]
    # the draft's 0.5 GB on the GPU would cost the target 6 layers: that layout was priced and lost
    on_gpu = next(o for o in p.options if o.layout.draft_gpu_layers == 25)
    assert on_gpu.layout.target_gpu_layers < p.target_gpu_layers and on_gpu.tokens_per_second < p.chosen.tokens_per_second
    assert p.chosen.gpu_bytes <= 3.7 * GiB * 0.9


@pytest.mark.parametrize("budget, k", [(DESKTOP_8G, 3), (GPU_24G, 1), (APPLE_16G, 3)], ids=["8G", "24G", "M2-16G"])
def test_7b_fits_with_its_draft_on_the_gpu_and_the_draft_pays(budget, k):
    p = plan(QWEN_7B, QWEN_05B, budget)
    assert _chosen(p) == ("target on the GPU, draft on the GPU, context 4096", True)
    assert p.chosen.k == k and "with the draft at K=" in p.reason
    plain = next(o for o in p.options if o.layout.draft_gpu_layers is None)
    assert p.chosen.tokens_per_second >= 1.1 * plain.tokens_per_second


def test_7b_on_a_cpu_drops_the_draft():
    p = plan(QWEN_7B, QWEN_05B, Budget("cpu", 16 * GiB))
    assert _chosen(p) == ("target on the CPU, no draft, context 4096", False)


def test_context_is_traded_for_the_whole_target_on_the_gpu_unless_the_user_set_it():
    tight = Budget("cuda", 16 * GiB, int(5.2 * GiB), gpu_name="NVIDIA GeForce RTX 3060")
    p = plan(QWEN_7B, None, tight)
    assert [o.description for o in p.options] == ["target on the GPU, no draft, context 3392",
                                                  "target 28/29 layers on the GPU, no draft, context 4096"]
    assert p.n_ctx == 3392 and "context reduced from 4096 to 3392 tokens to fit the GPU memory" in p.notes
    fixed = plan(QWEN_7B, None, tight, n_ctx=4096)
    assert fixed.n_ctx == 4096 and fixed.target_gpu_layers == 28 and len(fixed.options) == 1


def test_fixed_layers_are_kept_and_too_many_fail_with_the_numbers():
    p = plan(QWEN_7B, QWEN_05B, DESKTOP_8G, target_gpu_layers=10, draft_gpu_layers=0)
    assert (p.target_gpu_layers, p.draft_gpu_layers, p.load_draft) == (10, 0, True)
    assert {o.layout.target_gpu_layers for o in p.options} == {10}
    with pytest.raises(OutOfMemoryError, match=r"--gpu-layers 29 .* does not fit 3.33 GiB of GPU memory"):
        plan(QWEN_7B, None, LAPTOP_4G, target_gpu_layers=29)


def test_a_calibration_of_this_machine_replaces_the_model():
    # A CPU whose batches are nearly free (many cores) was calibrated: the draft now pays there.
    flat = {"target": (0.030, 0.031, 0.033, 0.036, 0.045, 0.07, 0.12), "draft": (0.010,)}
    p = plan(QWEN_15B, QWEN_05B, CPU_24G, measured=lambda which, layers: flat[which])
    assert p.load_draft and p.chosen.measured and p.chosen.k > 0
    assert not plan(QWEN_15B, QWEN_05B, CPU_24G).chosen.measured


def test_gpu_facts_by_name():
    assert gpu_bandwidth("cuda", "NVIDIA GeForce RTX 4070 Ti SUPER") == 504e9  # the longest name inside it
    assert gpu_bandwidth("metal", "Apple M3 Max") == 400e9 and gpu_bandwidth("metal", "Apple M9") == 100e9
    assert [gpu_kind(n) for n in ("CUDA0", "Metal", "Vulkan0", "ROCm0", "BLAS")] == ["cuda", "metal", "vulkan",
                                                                                   "rocm", "gpu"]


def test_an_idle_gpu_is_named_with_the_command_that_fixes_it(monkeypatch):
    monkeypatch.setattr(budget_module.sys, "platform", "linux")
    monkeypatch.setattr(budget_module, "_nvidia_gpu", lambda: "an NVIDIA GeForce RTX 3060 (11800 MiB free)")
    cpu_only = [SimpleNamespace(kind="cpu")]
    note = idle_gpu_note(cpu_only)
    assert "RTX 3060" in note and 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall' in note
    assert idle_gpu_note([*cpu_only, SimpleNamespace(kind="gpu")]) is None
    monkeypatch.setattr(budget_module, "_nvidia_gpu", lambda: None)
    assert idle_gpu_note(cpu_only) is None


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


def test_the_aside_sequence_of_edgespec_serve_is_counted_in_the_kv_cache():
    base, served = plan(QWEN_15B, None, CPU_24G, n_ctx=4096, n_seq=2), plan(QWEN_15B, None, CPU_24G, n_ctx=4096,
                                                                             n_seq=2, aside=1024)
    kv = lambda p: next(b for item, b in p.rows if "KV cache" in item)  # noqa: E731
    assert kv(served) - kv(base) == 28_672 * 1024 and "+ 1024 aside" in served.rows[1][0]


def test_the_budget_is_the_first_gpu_device_llama_cpp_reports():
    from edgespec.planning.budget import detect_budget

    cpu = SimpleNamespace(name="CPU", description="AMD EPYC", kind="cpu", free_bytes=24 * GiB, total_bytes=24 * GiB)
    cuda = SimpleNamespace(name="CUDA0", description="NVIDIA GeForce RTX 4060", kind="gpu", free_bytes=7 * GiB,
                           total_bytes=8 * GiB)
    b = detect_budget([cpu, cuda])
    assert (b.device, b.gpu_bytes, b.gpu_name) == ("cuda", 7 * GiB, "NVIDIA GeForce RTX 4060")
    assert "CUDA0 free memory" in b.source
    assert detect_budget([cpu, cuda], override=4 * GiB).gpu_bytes == 4 * GiB
    only_cpu = detect_budget([cpu], override=6 * GiB)
    assert (only_cpu.device, only_cpu.gpu_bytes, only_cpu.ram_bytes) == ("cpu", 0, 6 * GiB)


def test_a_target_whose_layers_all_sit_on_rpc_workers_plans_its_memory_here():
    """plan_memory passes the local share of the weights: none when RPC workers hold every layer. The plan then
    prices no speed here (planning.remote does) instead of dividing by a pass that reads nothing."""
    remote_only = replace(QWEN_15B, weights_bytes=0)
    p = plan(remote_only, QWEN_05B, Budget("cpu", 16 * GiB), n_ctx=4096)
    assert p.load_draft and p.n_ctx == 4096
