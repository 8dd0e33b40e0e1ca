"""The hardware the planner reasons about, each figure with its source: GPUs, their links, the fraction of those links
and of the tensor cores that real kernels reach, the latency of a collective, and what hides behind compute.

Units: FLOP/s, bytes, bytes/s, seconds. Decimal, as the vendors print them: 1 GB = 1e9 bytes, 400 Gb/s = 50e9 bytes/s.
Every bandwidth is per GPU and per direction (a vendor's "900GB/s NVLink" counts both directions: 450e9 here).
Nothing here is fitted to Llama 3's published throughput: LLAMA3_405B_RUNS, at the end, is what the planner is checked
against. SOURCES.md quotes each source and says how it was read. Stdlib only.
"""
from __future__ import annotations

from typing import NamedTuple


class Figure(NamedTuple):
    """One number and where it comes from."""
    value: float
    source: str


class GPU(NamedTuple):
    """One GPU as clusters are usually built with it (8 to a node, one NIC each). `source` names, for each figure,
    where it comes from."""
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s (the vendors' "with sparsity" figure is twice this)
    memory_bytes: int  # HBM as the vendor labels it: "80GB" = 80e9 bytes
    nvlink_bytes_per_s: float  # to the other GPUs of its node (NVLink, Infinity Fabric), per direction
    network_bytes_per_s: float  # to other nodes: its share of the node's NICs, per direction
    gpus_per_node: int  # GPUs on one NVLink (or Infinity Fabric) domain
    matmul_flops: float  # the fastest bf16 matmul measured on it (the best shape of a search; see MATMUL_EFFICIENCY)
    source: dict[str, str]


FIGURES = ("peak_flops", "memory_bytes", "nvlink_bytes_per_s", "network_bytes_per_s", "gpus_per_node", "matmul_flops")

NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
MAMF = ("Bekman, ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table', "
        "BF16 (github.com/stas00/ml-engineering @ 744d01e, 2026-08-22)")
NVLINK_TABLE = "ml-engineering, network/README.md, NVLink table (uni-directional column)"

GPUS: dict[str, GPU] = {
    "h100": GPU(
        "H100 SXM 80GB", 989.5e12, 80 * 10**9, 450e9, 50e9, 8, 794.5e12, {
            "peak_flops": f"{NVIDIA_H100} spec table: H100 SXM 'BFLOAT16 Tensor Core 1,979 TFLOPS*', '* Shown with "
                          "sparsity. Specifications 1/2 lower without sparsity' -> 1,979e12 / 2; = 1830 MHz x 528 "
                          "tensor cores x 512 FMA x 2 = 989.4e12 (ml-engineering, compute/accelerator, TFLOPS section)",
            "memory_bytes": f"{NVIDIA_H100}: 'GPU Memory 80GB'; Llama 3 paper 3.3.1: '80GB HBM3'",
            "nvlink_bytes_per_s": "NVIDIA, 'Introducing NVIDIA HGX H100' (developer blog): 'the NVLink bidirectional "
                                  f"speed of 900 gigabytes per second' -> 450e9 per direction; {NVLINK_TABLE}: 450",
            "network_bytes_per_s": "NVIDIA DGX H100 datasheet (as copied in public docs): 'GPUDirect RDMA Networking: "
                                   "4x OSFP ports serving 8x single-port NVIDIA ConnectX-7 VPI 400 Gb/s' -> one 400 "
                                   f"Gb/s NIC per GPU ({DGX_H100}); Llama 3 paper 3.3.1: '400 Gbps interconnects "
                                   "between GPUs'",
            "gpus_per_node": f"{DGX_H100}: 8x H100; Llama 3 paper 3.3.1: 'Each server is equipped with eight GPUs'",
            "matmul_flops": f"{MAMF}: H100 SXM 794.5 TFLOPS, best shape 2048x2048x13312, torch 2.7.0+cu126",
        }),
    "h200": GPU(
        "H200 SXM 141GB", 989.5e12, 141 * 10**9, 450e9, 50e9, 8, 794.5e12, {
            "peak_flops": "https://www.nvidia.com/en-us/data-center/h200/ (not read here): ml-engineering's TFLOPS "
                          "table (note 16) gives H200 SXM bf16 989, 'the same as H100' but for its memory",
            "memory_bytes": "https://www.nvidia.com/en-us/data-center/h200/ (via ml-engineering's memory table: H200 "
                            "SXM 141 GB HBM3e); MLCommons v4.1 H200-SXM-141GBx8: '141 GB'",
            "nvlink_bytes_per_s": "MLCommons inference v4.1, NVIDIA H200-SXM-141GBx8 system: '18x 4th Gen NVLink, "
                                  f"900GB/s' -> 450e9 per direction; {NVLINK_TABLE}: NVLink 4 'H100, H200, GH200' 450",
            "network_bytes_per_s": f"{DGX_H100} (the DGX H100/H200 user guide): 8x ConnectX-7 400 Gb/s, one per GPU",
            "gpus_per_node": f"{DGX_H100}: 8 GPUs",
            "matmul_flops": f"{MAMF}: the H100 SXM row, noted 'H200 is the same' (no H200 bf16 row of its own)",
        }),
    "a100": GPU(
        "A100 SXM 80GB", 312e12, 80 * 10**9, 300e9, 25e9, 8, 271.2e12, {
            "peak_flops": "NVIDIA A100 whitepaper: '432 Tensor Cores that deliver up to 312 TFLOPS of dense "
                          "mixed-precision FP16/FP32'; ml-engineering TFLOPS table: A100 SXM bf16 312 (nvidia.com "
                          "a100 page); = 1410 MHz x 432 x 256 FMA x 2 = 311.9e12",
            "memory_bytes": "https://www.nvidia.com/en-us/data-center/a100/ (via ml-engineering's memory table: A100 "
                            "SXM 80 GB HBM2e)",
            "nvlink_bytes_per_s": "NVIDIA DGX A100 specifications (as copied in public cluster docs): 'NVIDIA "
                                  "NVSwitch GPU-to-GPU Bandwidth 600 GB/s' (both directions) -> 300e9; "
                                  f"{NVLINK_TABLE}: NVLink 3 300",
            "network_bytes_per_s": "https://www.nvidia.com/en-us/data-center/dgx-a100/ (as copied in public cluster "
                                   "docs): '8x Single-Port Mellanox ConnectX-6 VPI 200Gb/s HDR InfiniBand'; NVIDIA's "
                                   "DGX A100 architecture: 'a one-to-one relationship between the IO cards and the "
                                   "GPUs'",
            "gpus_per_node": "https://www.nvidia.com/en-us/data-center/dgx-a100/: '8x NVIDIA A100 Tensor Core GPUs'",
            "matmul_flops": f"{MAMF}: A100 SXM 271.2 TFLOPS, best shape 1024x10240x5120, torch 2.6.0+cu126",
        }),
    "b200": GPU(
        "B200 (HGX/DGX B200)", 2.25e15, 180 * 10**9, 900e9, 50e9, 8, 1745.0e12, {
            "peak_flops": "https://www.nvidia.com/en-us/data-center/hgx/ (quoted, not read here): HGX B200 'FP16/BF16 "
                          "Tensor Core 36 PFLOPS' for 8 GPUs, 'Specification in Sparse. Dense is 1/2 sparse spec "
                          "shown' -> 36e15 / 8 / 2; ml-engineering TFLOPS table: B200 SXM bf16 2250 (DGX B200 "
                          "datasheet)",
            "memory_bytes": "https://www.nvidia.com/en-us/data-center/dgx-b200/ (quoted, not read here): '1,440 GB "
                            "total' for 8 GPUs -> 180 GB; ml-engineering's memory table: 180 (NVIDIA's HGX components "
                            "page); the launch announcement said 192 GB",
            "nvlink_bytes_per_s": "https://www.nvidia.com/en-us/data-center/hgx/ (quoted, not read here): 'NVLink "
                                  "GPU-to-GPU Bandwidth: 1.8 TB/s' (both directions) -> 900e9; "
                                  f"{NVLINK_TABLE}: NVLink 5 900",
            "network_bytes_per_s": "NVIDIA DGX B200 specifications (as copied in public docs): '4x OSFP ports serving "
                                   "8x single-port NVIDIA ConnectX-7 VPI (Up to 400Gb/s InfiniBand/Ethernet)'",
            "gpus_per_node": "https://www.nvidia.com/en-us/data-center/dgx-b200/: 8 GPUs",
            "matmul_flops": f"{MAMF}: B200 SXM 1745.0 TFLOPS, best shape 1792x16128x3072, torch 2.7.1+cu128",
        }),
    "mi300x": GPU(
        "MI300X 192GB", 1307.4e12, 192 * 10**9, 448e9, 50e9, 8, 668.4e12, {
            "peak_flops": "ml-engineering, compute/accelerator, TFLOPS section: 2100 MHz x 1216 matrix cores x 256 FMA "
                          "x 2 = 1307.4 TFLOPS, 'matches the published spec' (AMD's MI300X page, not read here; "
                          "often rounded to 1300)",
            "memory_bytes": "AMD's MI300X page (via ml-engineering's memory table: 192 GB HBM3); MLCommons v4.1 "
                            "8xMI300X system: '192 GB'",
            "nvlink_bytes_per_s": "Infinity Fabric: 7 links x 64 GB/s per direction = 448e9 to the other 7 GPUs "
                                  "together, 64e9 to any one of them (AMD's '128 GB/s' per link counts both "
                                  "directions; ml-engineering, network/README.md, Infinity Fabric table)",
            "network_bytes_per_s": "Azure ND MI300X v5 (8x MI300X): 'Infiniband: Supported, GPUDirect RDMA, 8x400 "
                                   "Gigabit NDR' (MicrosoftDocs/azure-docs, nd-mi300x-v5-series.md)",
            "gpus_per_node": "Azure ND MI300X v5: '8 MI300X'; AMD's MI300X platform: 8 GPUs",
            "matmul_flops": f"{MAMF}: MI300X 668.4 TFLOPS, best shape 10240x15360x8192, torch 2.5.1+rocm6.3, "
                            "PYTORCH_TUNABLEOP_ENABLED=1",
        }),
}

for _gpu in GPUS.values():  # a figure without its source is a bug in this file, not in the planner
    if set(_gpu.source) != set(FIGURES):
        raise ValueError(f"{_gpu.name}: sources for {sorted(_gpu.source)}, figures are {list(FIGURES)}")

# The fraction of peak a large bf16 matmul reaches on an H100: the best of a search over shapes, so a ceiling for the
# matmuls of a real model (whose shapes are fixed). Per GPU: GPUS[name].matmul_flops / GPUS[name].peak_flops.
MATMUL_EFFICIENCY = Figure(GPUS["h100"].matmul_flops / GPUS["h100"].peak_flops, GPUS["h100"].source["matmul_flops"])

# Bus bandwidth that NCCL's large collectives reach inside one node, as a fraction of the NVLink rate per direction
# (nccl-tests' busbw: the bytes each GPU's link carries over the time taken). Ring algorithm; 8 GPUs; 16 GiB.
NVSHARP = "ml-engineering, network/README.md, section SHARP: nccl-tests on 8x H200 (NVLink 4), 16 GiB, nccl 2.27.7"
NVLINK_EFFICIENCY: dict[str, Figure] = {
    "all_gather": Figure(361.4 / 450, f"{NVSHARP}: all_gather_perf 361.4 GB/s busbw of 450"),
    "reduce_scatter": Figure(362.9 / 450, f"{NVSHARP}: reduce_scatter_perf 362.9 GB/s busbw of 450"),
    "all_reduce": Figure(367.2 / 450, f"{NVSHARP}: all_reduce_perf, NCCL_NVLS_ENABLE=0, 367.2 GB/s busbw of 450; "
                                      "8x H100: 'difficult in practice to exceed 370 GB/s' (Austin et al., How to "
                                      "Scale Your Model, GPUs chapter)"),
    # With NVLink SHARP (NCCL's NVLS algorithm, the default on 8 Hopper GPUs) an all-reduce reports more than the
    # link: the switch reduces. All-reduce only; all-gather and reduce-scatter stay on the ring.
    "all_reduce_nvls": Figure(480.0 / 450, f"{NVSHARP}: all_reduce_perf, NVLS, 480.0 GB/s busbw; NVIDIA (nccl-tests "
                                           "issue 290): '476GB/s looks to be in the expected range for H100'"),
}

# Across nodes, per NIC. NVIDIA's NCCL maintainers give the range a healthy 400 Gb/s NIC reaches in nccl-tests; the
# value is its middle.
NETWORK_EFFICIENCY = Figure(47e9 / 50e9, "NVIDIA/nccl-tests issue 290 (NVIDIA, 2025-03-03): 'For NDR @ 400Gbps you "
                                         "should see 46-48GB/s per NIC'; issue 319 (2025-06-11): 'around 48GB/s from "
                                         "each CX7 NIC at 400Gbps'; NVIDIA/nccl issue 812: DGX A100, 8x 200 Gb/s, "
                                         "'192GB/s AllReduce BusBW' (0.96). Middle of 46-48 of 50")

# The time a collective takes before its bytes: NCCL's own cost model (what it uses to choose an algorithm), ring
# algorithm, Simple protocol (the one large messages use). A ring collective over n ranks takes n - 1 steps
# (all-gather, reduce-scatter) or 2(n - 1) (all-reduce); each step that crosses nodes costs the network latency.
NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc @ 5067397 (2026-06-11), ncclTunerConstantsDefaults, Ring/Simple"
COLLECTIVE_LATENCY_S = Figure(8.4e-6, f"{NCCL_TUNING}: baseLatencies 8.4 us")
NVLINK_STEP_LATENCY_S = Figure(3.4e-6, f"{NCCL_TUNING}: hwLatencies NVLINK 3.4 us per step")
NETWORK_STEP_LATENCY_S = Figure(14e-6, f"{NCCL_TUNING}: hwLatencies NET 14 us per step (the topology adds its own); "
                                       "Llama 3 paper 3.3.3: network 'latency up to tens of microseconds'")

# What hides behind compute, per kind of communication: a modelling choice, each with where it is described. The value
# is the fraction of that communication which may overlap compute; it never hides more than the compute beside it.
OVERLAP: dict[str, Figure] = {
    "dp": Figure(1.0, "FSDP2 issues the next block's all-gather on another stream: 'layer 1 all-gather can overlap "
                      "with layer 0 forward compute ... (The 1st all-gather will not be able to overlap with "
                      "anything.)' (PyTorch docs, notes/fsdp.html, FSDP Prefetch Nuances); likewise the backward's "
                      "last reduce-scatter has nothing after it. DDP all-reduces a bucket of gradients while the "
                      "backward computes the next (PyTorch docs, notes/ddp.html); its last bucket is exposed. Llama 3 "
                      "paper 3.3.2: DP 'can tolerate longer network latency by asynchronously prefetching sharded "
                      "model weights and reducing gradients'"),
    "tp": Figure(0.0, "Exposed: the next matmul needs the collective's result (Shoeybi et al. 2019, Megatron-LM, its "
                      "f and g operators); the stages' tp (torch's parallelize_module) waits for each one"),
    "cp_ring": Figure(1.0, "Hidden up to the attention beside it: ring attention sends the next key-value block while "
                           "attending to the one held, 'fully overlapping the communication of key-value blocks with "
                           "the computation of blockwise attention' (Liu et al. 2023, arXiv 2310.01889); the stages' "
                           "ring_attention does so (13_pipeline_4d/context_parallel.py)"),
    "cp_allgather": Figure(0.0, "Exposed: Llama 3 paper 3.3.2 (p. 11): 'the all-gather communication latency is "
                                "exposed in the critical path'"),
    "pp": Figure(1.0, "Hidden: Llama 3 paper 3.3.2 (p. 11): 'asynchronous point-to-point communication in PP', 'more "
                      "micro-batches to hide point-to-point communication'. The bubble is counted apart: (PP - 1) / "
                      "(V * M) of the step (same page; Narayanan et al. 2021)"),
    "ep": Figure(0.0, "Exposed: the experts' matmuls need the tokens the all-to-all brings; stage 14 dispatches and "
                      "combines in line (a modelling choice; nothing measured)"),
}


class Run(NamedTuple):
    """One published layout of Llama 3 405B's pre-training (the Llama 3 paper, Table 4)."""
    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    sequence: int  # tokens per sequence
    sequences_per_dp: int  # the table's "Batch size/DP": sequences per dp rank per step
    flops_per_gpu: float  # the table's "TFLOPs/GPU" (bf16)
    mfu: float  # the table's "BF16 MFU"
    source: str

    @property
    def tokens_per_batch(self) -> int:  # the table prints "16M": 2**24 = 16,777,216
        return self.dp * self.sequences_per_dp * self.sequence


TABLE4 = "Llama 3 paper (arXiv 2407.21783), 3.3.2, Table 4 (p. 10)"
TALK = "'Herding Llamas', P. Balaji, SC'24 (slide as quoted at glennklockwood.com/garden/llama-3.1)"
LLAMA3_405B_RUNS: list[Run] = [
    Run(8192, 8, 1, 16, 64, 8192, 32, 430e12, 0.43, f"{TABLE4}; {TALK}: the same GPUs, TP, CP, PP, 16M, 430"),
    Run(16384, 8, 1, 16, 128, 8192, 16, 400e12, 0.41, f"{TABLE4}; {TALK}: the same, 400"),
    # The paper prints DP 4 here. 16,384 / (8 x 16 x 16) = 8, and only 8 gives its 16M tokens per batch
    # (16 x 8 x 131,072 = 2**24): 4 is a misprint of 8. The talk's slide has no DP column.
    Run(16384, 8, 16, 16, 8, 131072, 16, 380e12, 0.38, f"{TABLE4} (printed DP 4, see above); {TALK}: the same, 380"),
]

class Fact(NamedTuple):
    """What Llama 3 405B's pre-training did, and where it is said (None: not said)."""
    value: object
    source: str


P = "Llama 3 paper (arXiv 2407.21783)"
LLAMA3_405B_TRAINING: dict[str, Fact] = {
    "gpu": Fact("H100 80GB HBM3, 700 W",
                f"{P} 3.3.1 (p. 9): 'up to 16K H100 GPUs, each running at 700W TDP with 80GB HBM3'"),
    "gpus_per_node": Fact(8, f"{P} 3.3.1 (p. 9): 'Each server is equipped with eight GPUs and two CPUs. Within a "
                             "server, the eight GPUs are connected via NVLink'"),
    "network": Fact("RoCE, 400 Gb/s per GPU", f"{P} 3.3.1 (p. 9): a RoCE fabric; 'Both RoCE and Infiniband clusters "
                                              "leverage 400 Gbps interconnects between GPUs'"),
    "pod_gpus": Fact(3072, f"{P} 3.3.1 (p. 9): pods of 3,072 GPUs 'with full bisection bandwidth'; between pods 'an "
                           "oversubscription ratio of 1:7'"),
    "mesh_order": Fact("tp, cp, pp, dp", f"{P} 3.3.2 (p. 12): '[TP, CP, PP, DP]', innermost first: TP in a server"),
    "tensor_parallelism": Fact("Megatron's, with sequence parallelism (cited, not named)",
                               f"{P} 3.3.2: 'It combines tensor parallelism (TP; Krizhevsky et al. (2012); Shoeybi et "
                               "al. (2019); Korthikanti et al. (2023))': Korthikanti et al. introduced sequence "
                               "parallelism; the paper does not name it in words"),
    "dp": Fact("FSDP, weights kept gathered from forward to backward",
               f"{P} 3.3.2 (p. 10): 'Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model "
               "shards we do not reshard after forward computation to avoid an extra all-gather communication during "
               "backward passes'"),
    "gradient_dtype": Fact("float32", f"{P} 3.3.2 (p. 12): 'we use FP32 gradient accumulation during backward "
                                      "computation over multiple micro-batches and also reduce-scatter gradients in "
                                      "FP32 across data parallel workers in FSDP'"),
    "activation_checkpointing": Fact(False, f"{P} 3.3.2 (p. 11): 'we could pre-train Llama 3 on sequences of 8K "
                                            "tokens without activation checkpointing' (the 128K row: not stated)"),
    "pipeline_schedule": Fact("interleaved", f"{P} 3.3.2 (p. 11): 'we use an interleaved schedule (Narayanan et al., "
                                             "2021) with V pipeline stages on one pipeline rank'; N, the micro-batches "
                                             "run back to back per stage, tunable (Figure 6)"),
    "pipeline_bubble": Fact("(PP - 1) / (V * M)", f"{P} 3.3.2 (p. 11): 'Overall pipeline bubble ratio', M the "
                                                  "micro-batches of a step"),
    "embedding_and_head_stages": Fact("one fewer block each",
                                      f"{P} 3.3.2 (p. 11): 'we reduce one Transformer layer each from the first and "
                                      "the last stages ... the first model chunk on the first stage has only the "
                                      "embedding, and the last model chunk on the last stage has only output "
                                      "projection and loss calculation'"),
    # Not stated. 126 blocks on 16 ranks, a chunk with only the embedding and one with only the head, each 'one
    # Transformer layer' short of the others: only V = 8 chunks of one block fits (16 x 8 = 128 = 126 + 2).
    "virtual_stages": Fact(8, "derived, not stated (see the comment above); the paper gives no V"),
    "micro_batches": Fact(None, f"not found: {P} Table 4 gives sequences per DP rank (32, 16, 16), not the size of a "
                                "micro-batch"),
    "context_parallelism": Fact("all-gather K and V",
                                f"{P} 3.3.2 (pp. 11-12): the sequence in 2 x CP chunks, rank i holding chunks i and "
                                "2 x CP - 1 - i; 'we first all-gather the key (K) and value (V) tensors, and then "
                                "compute attention output for the local query (Q) tensor chunk'"),
    "optimizer": Fact("AdamW", f"{P} 3.4.1: 'We pre-train Llama 3 405B using AdamW'"),
    "collectives": Fact("NCCLX", f"{P} 3.3.3 (p. 12): 'based on a fork of Nvidia's NCCL library, called NCCLX'"),
    "mfu_definition": Fact("Chowdhery et al. (PaLM)", f"{P} 3.3.2 (p. 10): 'BF16 Model FLOPs Utilization (MFU; "
                                                      "Chowdhery et al. (2023))'"),
    "mfu_peak_flops": Fact(None, "not stated: Table 4 gives 430/0.43 = 1000, 400/0.41 = 976, 380/0.38 = 1000 TFLOP/s, "
                                 "both columns rounded; at the H100's 989.5 the rows read 43%, 40%, 38%"),
}
