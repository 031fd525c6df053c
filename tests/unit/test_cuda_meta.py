"""The CUDA configuration, run without a GPU: the ``small`` preset on PyTorch's meta device in the CUDA
precision policy, under :class:`bench.device_audit.DeviceAudit` (Base, and Instruct's text phase).

What CUDA would refuse or pay for and the CPU tests never meet: a matmul whose operands mix bfloat16
and float32, a tensor left on the CPU (created without ``device=``) meeting the model's, and host
synchronisations in the step. Meta tensors have shapes and dtypes but no data, so every op runs
(in milliseconds) and every read by the host gets a stand-in (zeros: stop probabilities of 0 keep the
streams going).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bench.device_audit import CPU_SCALAR, D2H, H2D_ASYNC, H2D_BLOCKING, SYNC, DeviceAudit, DeviceAuditError
from bench.gpu import random_model
from bench.step_syncs import STOP_ROW_BYTES, TEXT_ROW_BYTES
from engine.checkpoint import precision_policy
from engine.chunking import ChunkSchedule
from engine.fireredtts3 import FireRedTTS3
from engine.generator_state import Phase
from engine.params import GenerationParams
from engine.protocol import SAMPLE_RATE, Chunk
from engine.streams import GeneratorService
from engine.text import TextTokenizer, write_tiny_tokenizer
from engine.vocoder_service import VocoderService

BF16, FP32 = torch.bfloat16, torch.float32
STREAMS, STEPS = 4, 3
# the first chunk falls due on the last step, so the vocoder gets real chunks
SCHEDULE = ChunkSchedule(STEPS, 12, fixed=True)

# Host syncs (device -> host reads, and copies to the device without non_blocking=True, which PyTorch
# ends with cudaStreamSynchronize) each stage may make; every one stalls the host until the GPU is idle.
# A generator step: exactly one, the stop decision (the stop probabilities' .tolist()): whether a
# stream stops decides whether it gets a flow call, so it cannot wait for a later step.
STEP_SYNCS = 1
# ... plus one device -> host copy for each chunk that falls due in the step: its latents leave the
# GPU for the vocoder as numpy (GeneratorService._chunk). One copy per stream per chunk (every 12
# patches); all the chunks due in a step could share one copy.
SYNCS_PER_CHUNK = 1
# A vocoder chunk: one, its samples to the host (they leave as numpy).
VOCODER_SYNCS_PER_CHUNK = 1
# A reference clip (once per voice, not per step): its latents and its speaker embedding go to the
# host (a VoicePrompt lives on the CPU, to be stored and hashed), and the audio and the fbank frames
# come from the host; the copies in are followed by a read anyway.
ENCODE_SYNCS = 4
# Admitting a stream: none (its token ids go to the device with non_blocking=True).
ADMIT_SYNCS = 0
# Instruct's text phase adds one read per step for all its rows: the picked ids, TEXT_ROW_BYTES each
# (scores, processors and draws stay on the device); before, every row's 151,936 float32 scores came over.
TEXT_SYNCS = 1


@pytest.fixture(scope="module")
def run():
    """The small preset in the CUDA policy on meta: prompt encoding (RedAE encoder and CAM++), 4 streams
    admitted, 3 generator steps over the paged cache (SDPA), and the vocoder chunks they produce."""
    model = random_model("small", "meta", dtype=precision_policy(torch.device("cuda")), campp=True)
    audits = {}
    with DeviceAudit("meta") as audits["encode"]:
        prompt = model.encode_prompt(np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE, "a reference")
    service = GeneratorService(model, slots=STREAMS, max_len=256, attention="sdpa")
    # two Euler steps: a sync inside the flow's loop would show twice per step; the default ten would
    # only cost time (every op on meta runs PyTorch's meta kernels, many of them Python)
    params = GenerationParams(seed=1, steps=2, max_patches=16)
    with DeviceAudit("meta") as audits["admit"]:
        for i in range(STREAMS):
            service.admit(i, [1, 2, 3 + i], prompt, params, schedule=SCHEDULE)
    steps = []
    for _ in range(STEPS):
        with DeviceAudit("meta") as audit:
            chunks = service.step(list(range(STREAMS)))
        steps.append((audit, [c for c in chunks.values() if c is not None]))
    vocoder = VocoderService(model)
    with DeviceAudit("meta") as audits["vocoder"]:
        audio = vocoder.process_many(steps[-1][1])
    # every stream's next chunk (as the generator would send it 12 steps later): past the priming
    # transient, so the four decode in one batched forward
    later = [Chunk(i, np.zeros((4 * 12, 64), np.float32), np.zeros((0, 64), np.float32), False, seq=1)
             for i in range(STREAMS)]  # fmt: skip
    with DeviceAudit("meta") as audits["vocoder batched"]:
        audio += vocoder.process_many(later)
    return {"model": model, "prompt": prompt, "steps": steps, "audio": audio, "vocoder_rows": vocoder.batched_rows,
            **audits}  # fmt: skip


def test_meta_model_follows_the_cuda_precision_policy(run):
    core, redae = run["model"].core, run["model"].models.redae
    assert core.backbone_llm.layers[0].mlp.up_proj.weight.dtype == BF16 and core.dit_head.weight.dtype == FP32
    assert {p.dtype for p in redae.encoder.parameters()} == {BF16}
    assert {p.dtype for p in redae.decoder.parameters()} == {FP32}
    assert {p.device.type for p in core.parameters()} == {"meta"}


def test_prompt_encoding_runs_the_encoder_in_bf16_and_campp_in_fp32(run):
    audit, prompt = run["encode"], run["prompt"]
    assert prompt.latents.device.type == "cpu" and prompt.latents.shape == (28, 64)  # 1 s: 7 patches of 4
    assert prompt.speaker.shape == (run["model"].core.cfg.spk_in_dim,)
    dtypes = {dtype for (_, dtype) in audit.matmuls}
    assert dtypes == {BF16, FP32}, audit.matmuls  # RedAE encoder bf16, CAM++ fp32
    assert {dtype for (op, dtype) in audit.matmuls if op.startswith("conv")} == {FP32}, audit.matmuls  # CAM++
    assert audit.count(SYNC) <= ENCODE_SYNCS, audit.report()
    assert audit.count(D2H) == 2, audit.report()  # the latents and the speaker embedding, nothing else


def test_admission_makes_no_host_sync(run):
    assert run["admit"].count(SYNC) == ADMIT_SYNCS, run["admit"].report()


def test_generator_steps_stay_within_the_sync_budget(run):
    for step, (audit, chunks) in enumerate(run["steps"], 1):
        budget = STEP_SYNCS + SYNCS_PER_CHUNK * len(chunks)
        assert audit.count(SYNC) <= budget, f"step {step}: {len(chunks)} chunks due\n{audit.report()}"
        assert audit.count(H2D_BLOCKING) == 0, f"step {step}\n{audit.report()}"
        # the stop decision, once per step (the audio rows of engine.generator.Generator.step)
        stop = [n for (kind, _, site), n in audit.sites.items() if kind == D2H and "generator.py" in site]
        assert stop == [1], audit.report()
    first, *_ = run["steps"]
    assert first[0].count(H2D_ASYNC) > 0  # the noise, drawn on the CPU per stream, goes over non-blocking
    assert [len(chunks) for _, chunks in run["steps"]] == [0, 0, STREAMS]


def test_generator_steps_run_the_backbone_in_bf16_and_the_flow_in_fp32(run):
    for audit, _ in run["steps"]:
        ops = audit.matmuls
        assert {dtype for (_, dtype) in ops} == {BF16, FP32}, ops
        sdpa = {dtype for (op, dtype) in ops if "scaled_dot_product" in op}
        assert sdpa == {BF16, FP32}, ops  # the backbone's attention, and the DiT's and the PatchEncoder's
        assert {dtype for (op, dtype) in ops if op.startswith("conv")} == {FP32}, ops  # the DiT's conv blocks


def test_vocoder_chunks_run_in_fp32_with_one_sync_per_chunk(run):
    audit, chunks = run["vocoder"], run["steps"][-1][1]
    assert all(isinstance(a, np.ndarray) for a in run["audio"]), run["audio"]
    assert {dtype for (_, dtype) in audit.matmuls} == {FP32}, audit.matmuls
    assert audit.count(SYNC) <= VOCODER_SYNCS_PER_CHUNK * len(chunks), audit.report()
    assert audit.count(H2D_BLOCKING) == 0, audit.report()


def test_vocoder_batched_round_syncs_once_for_all_streams(run):
    audit = run["vocoder batched"]
    assert run["vocoder_rows"] == STREAMS  # the four chunks went through one decode_together
    assert {dtype for (_, dtype) in audit.matmuls} == {FP32}, audit.matmuls
    assert audit.count(SYNC) == 1, audit.report()  # the batch's samples, once


# ---- Instruct: text-phase rows (sampled and greedy) beside audio-phase rows --------------------------------
TEXTS = {1: ("design", "a calm voice", "Hello there."), 2: ("semantic_edit", "delete the word at index 1.", ""),
         3: ("design", "a bright young voice", "Hi."), 4: ("design", "an old man, slowly", "Good day.")}  # fmt: skip
AUDIOS = {5: ("acoustic_edit", "adjust the speed to 0.5x", ""), 6: ("clone", "", "Hello.")}


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """Both cores of the small preset on meta in the CUDA policy (and a tiny tokenizer for the ChatML):
    4 text-phase streams (3 designs, sampled; a semantic edit, greedy) and 2 audio-phase streams admitted
    through the service, then 3 steps, each audited. No chunk falls due: the first is 4 patches."""
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(folder)
    model = random_model("small", "meta", dtype=precision_policy(torch.device("cuda")), instruct=True)
    models = dataclasses.replace(model.models, tokenizer=TextTokenizer.from_dir(folder))
    model = FireRedTTS3(models, model.device, model.dtype, model.dtypes)
    svc = GeneratorService(model, slots=len(TEXTS) + len(AUDIOS), max_len=1024, attention="sdpa")
    params = GenerationParams(seed=2, steps=2, cfg=1.2, max_patches=8, min_patches=0)
    latents = torch.zeros(4 * 5, 64)
    with DeviceAudit("meta") as admit:
        for sid, (task, instruction, text) in {**TEXTS, **AUDIOS}.items():
            recording, prompt_text = (None, "") if task == "design" else (latents, "Hi." if task == "clone" else "")
            svc.admit_task(
                sid,
                task,
                params,
                instruction,
                text,
                recording,
                prompt_text,
                schedule=ChunkSchedule(STEPS + 1, 12, fixed=True),
            )
    steps = []
    for _ in range(STEPS):
        with DeviceAudit("meta") as audit:
            chunks = svc.step(list(svc.live))
        steps.append((audit, sum(c is not None for c in chunks.values())))
    return {"svc": svc, "admit": admit, "steps": steps}


def test_instruct_admission_makes_no_host_sync(instruct):
    assert instruct["admit"].count(SYNC) == ADMIT_SYNCS, instruct["admit"].report()


def test_instruct_text_rows_send_only_their_token_ids_to_the_host(instruct):
    svc = instruct["svc"]
    assert {sid: svc.live[sid].state.phase for sid in svc.live} == {**dict.fromkeys(TEXTS, Phase.TEXT),
                                                                    **dict.fromkeys(AUDIOS, Phase.AUDIO)}  # fmt: skip
    budget = TEXT_ROW_BYTES * len(TEXTS) + STOP_ROW_BYTES * len(AUDIOS)
    for step, (audit, due) in enumerate(instruct["steps"], 1):
        assert due == 0
        # one read for all text rows (their ids), one for the audio rows (the stop decision)
        assert audit.count(SYNC) <= STEP_SYNCS + TEXT_SYNCS and audit.count(H2D_BLOCKING) == 0, audit.report()
        assert audit.d2h_bytes() <= budget, f"step {step}: {audit.d2h_bytes()} bytes > {budget}\n{audit.report()}"
        assert audit.d2h_bytes("text_sampling.py") == TEXT_ROW_BYTES * len(TEXTS), audit.report()


def test_instruct_steps_keep_the_cuda_precision_policy(instruct):
    for audit, _ in instruct["steps"]:
        assert {dtype for (_, dtype) in audit.matmuls} == {BF16, FP32}, audit.matmuls  # backbone, heads / flow


# ---- the audit itself, on hand-built ops: what it must catch, count and stand in for ----------------


def test_audit_refuses_a_matmul_that_mixes_dtypes():
    w = torch.nn.Linear(8, 8, device="meta", dtype=BF16)
    with pytest.raises(DeviceAuditError, match=r"(linear|addmm).*mixes dtypes.*(float32.*bfloat16|bfloat16.*float32)"):
        with DeviceAudit("meta"):
            w(torch.zeros(2, 8, device="meta"))
    a = torch.zeros(2, 4, 8, device="meta")
    for mixed in (
        lambda: torch.bmm(a, a.transpose(1, 2).to(BF16)),
        lambda: torch.nn.functional.conv1d(a, torch.zeros(3, 4, 3, device="meta", dtype=BF16)),
        lambda: torch.nn.functional.scaled_dot_product_attention(a[None], a[None].to(BF16), a[None]),
    ):
        with pytest.raises(DeviceAuditError, match="mixes dtypes"):
            with torch.inference_mode(), DeviceAudit("meta"):  # as the engine runs (SDPA is refused whole)
                mixed()


def test_audit_refuses_a_cpu_tensor_meeting_the_device_but_not_a_cpu_scalar():
    x = torch.zeros(3, device="meta")
    with pytest.raises(DeviceAuditError, match="CPU tensor meets meta"):
        with DeviceAudit("meta"):
            x + torch.ones(3)
    with pytest.raises(DeviceAuditError, match="test_cuda_meta.py"):  # names our line
        with DeviceAudit("meta"):
            x[torch.tensor([0, 1])]  # CUDA accepts CPU indices, and copies them over with a sync
    with DeviceAudit("meta") as audit:
        y = x * torch.tensor(2.0)  # a 0-d CPU tensor is a scalar to CUDA, read on the host
    assert y.device.type == "meta" and audit.by_op[CPU_SCALAR, "mul"] == 1


def test_audit_counts_host_syncs_and_reads_meta_tensors_as_zeros():
    x = torch.zeros(3, device="meta")
    with DeviceAudit("meta") as audit:
        assert x.tolist() == [0.0, 0.0, 0.0]
        assert x.sum().item() == 0.0 and not bool(x.any())
        assert torch.equal(x, x.clone())
        assert x.cpu().device.type == "cpu"
        torch.ones(3).to("meta")  # blocking: a sync
        torch.ones(3).to("meta", non_blocking=True)
        torch.tensor([1.0, 2.0], device="meta")  # from data: always blocking
        torch.ones(3).to("meta", torch.bfloat16, non_blocking=True)
        x[:0].cpu()  # nothing to move
    assert audit.count(D2H) == 5 and audit.count(H2D_BLOCKING) == 2 and audit.count(H2D_ASYNC) == 2
    assert audit.count(SYNC) == 7
    assert audit.by_op[H2D_BLOCKING, "tensor(data, device=)"] == 1
    assert all("test_cuda_meta.py" in site for (_, _, site) in audit.sites), audit.report()


def test_audit_counts_the_bytes_each_read_hands_the_host():
    x = torch.zeros(3, device="meta")  # float32
    with DeviceAudit("meta") as audit:
        x.tolist()  # 3 x 4
        x.sum().item()  # 4
        bool(x.any())  # a bool: 1
        torch.equal(x, x)  # 1
        x.to("cpu", torch.float64)  # 3 x 8: converted before it crosses
        torch.empty(2, 3, dtype=torch.int16).copy_(torch.zeros(2, 3, device="meta"))  # into int16: 6 x 2
        x[:0].cpu()  # nothing
        torch.zeros(5).to("meta", non_blocking=True)  # to the device: not counted
    assert audit.d2h_bytes() == 12 + 4 + 1 + 1 + 24 + 12, audit.report()
    assert audit.d2h_bytes("test_cuda_meta.py") == audit.d2h_bytes() and audit.d2h_bytes("elsewhere.py") == 0
    assert "(24 bytes)" in audit.report()


def test_a_random_op_on_meta_runs_without_its_cpu_generator():
    # PyTorch has no meta generator; the engine hands meta ops a CPU one, which they must neither refuse
    # (exponential_'s meta kernel refuses any generator) nor advance
    generator = torch.Generator().manual_seed(5)
    before = generator.get_state()
    with DeviceAudit("meta"):
        q = torch.empty(2, 7, device="meta").exponential_(1, generator=generator)
    assert q.device.type == "meta" and q.shape == (2, 7) and torch.equal(generator.get_state(), before)
    with pytest.raises(AssertionError, match="generator"):  # what the audit stands in for
        torch.empty(2, 7, device="meta").exponential_(1, generator=generator)


def test_audit_is_for_an_accelerator():
    with pytest.raises(ValueError, match="accelerator"):
        DeviceAudit("cpu")
