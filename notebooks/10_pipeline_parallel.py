# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 10: the layers split over processes, micro-batches flowing through, and still stage 01's weights
#
# Stage 07 split the model *between* layers, inside one process: `body` on one device, `head` on
# another, and one device always waited for the other. **Pipeline parallelism** puts each run of
# consecutive layers (a **stage**) in a process of its own, and keeps the stages busy at the same
# time by cutting each batch into **micro-batches**: while stage 1 computes micro-batch 0, stage 0
# already computes micro-batch 1. A stage talks only to its two neighbours: it receives the
# activations of each micro-batch from the stage before and sends its own to the stage after;
# in the backward pass the gradients come back the same way.
#
# | | 07: model parallel | 09: tensor parallel | 10: pipeline parallel |
# |---|---|---|---|
# | what is cut | the model, between layers | every layer, inside its matrix | the model, between layers |
# | who computes | one device at a time | all tp ranks at once, a slice each | all stages at once, a micro-batch each |
# | talk | activations across the cut, in one process | collectives inside every layer | send/recv with a neighbour |
#
# It is the split that reaches furthest: the talk is point-to-point, between neighbours, activations
# rather than weights, so a pipeline stretches across nodes where tensor parallelism cannot.
# Stage 10 cuts the 3 layers of stage 01's model into `--pp` stages (2 here: `body.0` | `head.0`,
# `head.2`, stage 07's cut), cuts each batch into `--microbatches` M (4 here) and orders the
# micro-batches' forwards and backwards by a `--schedule`: GPipe or 1F1B.

# %%
import json
import runpy

import matplotlib.pyplot as plt
import nbtools as nb
import torch
import torch.nn.functional as F
from matplotlib.patches import Patch

from benchmarks import pipeline_bubble as pb  # its slot_clock() plays a schedule on the schedule's own clock

cfg = nb.setup()
hand = pb.by_hand()  # 10_pipeline_parallel/by_hand.py as a module: GPipe and 1F1B written on send/recv

# %% [markdown]
# ## The picture: GPipe and 1F1B
#
# Both schedules run every micro-batch's forward (F) and backward (B) on every stage; they differ in
# the order:
#
# - **GPipe** runs all M forwards, then all M backwards. Simple, but autograd keeps each
#   micro-batch's activations until its backward, so every stage holds all M at its peak.
# - **1F1B** (one forward, one backward) runs P − s − 1 forwards on stage s to fill the pipeline,
#   then alternates one forward and one backward, then finishes the backwards. A micro-batch's
#   activations are freed as soon as its backward is done: stage s never holds more than P − s.
#
# Below, P = 4 stages and M = 8 micro-batches, played by `slot_clock` from `by_hand.py`'s own
# `gpipe()` and `one_f_one_b()`: each stage gets its order of calls from the function, then every
# forward takes 1 slot and every backward 2 (it computes two gradients per layer), each starting when
# its stage is free and its input has arrived from the neighbour. That is the schedule on P perfectly
# even devices, with free communication; not measured (the run's own timeline comes further down).
# Each colour is one micro-batch, flowing down the stages in its forward and back up in its backward;
# the grey is the **bubble**, where a stage sits idle waiting for its neighbour.

# %%
P, M = 4, 8
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}
plays = {name: pb.slot_clock(hand, name, P, M) for name in SCHEDULES}


def draw(ax, timelines: list, title: str, unit: str) -> None:
    """Each stage a lane; each forward a solid bar, each backward a hatched one, coloured by micro-batch."""
    span = max(end for line in timelines for *_, end in line)
    for s, line in enumerate(timelines):
        for kind, mb, start, end in line:
            ax.barh(s, end - start, left=start, height=0.7, color=f"C{mb % 10}", alpha=1.0 if kind == "F" else 0.6,
                    hatch=None if kind == "F" else "///", edgecolor="black", linewidth=0.5)
            fits = end - start >= span / 45
            ax.text((start + end) / 2, s if fits else s - 0.45, f"{kind}{mb}", ha="center",
                    va="center" if fits else "bottom", fontsize=7 if fits else 6)
    ax.set_yticks(range(len(timelines)), [f"stage {s}" for s in range(len(timelines))])
    ax.set(xlim=(0, span), ylim=(len(timelines) - 0.4, -0.75), xlabel=unit, facecolor="0.88")
    ax.set_title(title, fontsize=10, loc="left")


def held_over_time(line: list) -> tuple[list[float], list[int]]:
    """Micro-batches whose activations a stage holds: one more at each forward, one fewer after each backward."""
    change: dict[float, int] = {}
    for kind, _, start, end in line:
        when = start if kind == "F" else end  # kept from the forward on, freed once the backward is done
        change[when] = change.get(when, 0) + (1 if kind == "F" else -1)
    times, held = [0.0], [0]
    for when in sorted(change):
        times.append(when)
        held.append(held[-1] + change[when])
    return times, held


fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [1, 1, 0.8]})
for ax, (name, play) in zip(axes, plays.items(), strict=False):
    draw(ax, play["timelines"], f"{SCHEDULES[name]}: bubble {play['bubble']:.1%}; activations held at most, "
         f"per stage: {play['peak_held']}", "")
for name, style in (("gpipe", "-"), ("1f1b", "--")):
    times, held = held_over_time(plays[name]["timelines"][0])
    axes[2].step(times, held, style, where="post", lw=2, label=SCHEDULES[name])
    assert max(held) == plays[name]["peak_held"][0], (name, max(held))
axes[2].set(xlabel="slots (a forward 1, a backward 2)", ylabel="micro-batches", ylim=(0, M + 1))
axes[2].set_title("activations held by stage 0 (the most of any stage), over the step", fontsize=10, loc="left")
axes[2].legend(handles=[*axes[2].get_lines(), Patch(facecolor="0.6", edgecolor="black", label="forward (above)"),
                        Patch(facecolor="0.6", edgecolor="black", hatch="///", alpha=0.6, label="backward"),
                        Patch(facecolor="0.88", label="idle: the bubble")], loc="upper right", fontsize=8, ncol=2)
fig.suptitle(f"P = {P} stages, M = {M} micro-batches, on the schedule's own clock", fontsize=11)
fig.tight_layout()
nb.show(fig)

span = {name: max(end for line in play["timelines"] for *_, end in line) for name, play in plays.items()}
print(f"one step: {span['gpipe']:g} slots with either schedule = 3 × (M + P − 1); bubble "
      f"{plays['gpipe']['bubble']:.1%} = (P − 1) / (M + P − 1) with both")
print(f"activations held at most, per stage: GPipe {plays['gpipe']['peak_held']} (M everywhere), "
      f"1F1B {plays['1f1b']['peak_held']} (P − s on stage s)")
assert span["gpipe"] == span["1f1b"] == 3 * (M + P - 1), span
assert all(abs(play["bubble"] - pb.theory(P, M)) < 1e-12 for play in plays.values()), plays
assert plays["gpipe"]["peak_held"] == [M] * P and plays["1f1b"]["peak_held"] == [P - s for s in range(P)], plays

# %% [markdown]
# The same bubble, (P − 1) / (M + P − 1): P − 1 slots' worth of filling at the start and draining at
# the end, whatever the order in between. So more micro-batches make it smaller; but under GPipe each
# one more is one more micro-batch of activations held on every stage, while 1F1B's stay at P − s.
# That is what lets M grow. Played out for P = 4:

# %%
print(" M | bubble (theory) | GPipe: held at most, per stage | 1F1B")
for m in (4, 8, 16, 32):
    g, f = (pb.slot_clock(hand, name, P, m) for name in SCHEDULES)
    print(f"{m:>2} | {g['bubble']:6.1%} ({pb.theory(P, m):5.1%}) | {str(g['peak_held']):30} | {f['peak_held']}")
    assert abs(g["bubble"] - pb.theory(P, m)) < 1e-12 and abs(f["bubble"] - pb.theory(P, m)) < 1e-12, (m, g, f)
    assert g["peak_held"] == [m] * P and f["peak_held"] == [P - s for s in range(P)], (m, g, f)

# %% [markdown]
# ## What changed from stage 05
#
# Stage 10 starts from 05 (torchrun, several nodes) and takes 07's idea, the cut between layers,
# across processes (it leaves out 06's snapshots). `split_layers` cuts the model's layers into `--pp`
# runs of whole layers, and each process keeps its own run and gives the optimizer only its
# weights. `main` builds a 2-D mesh of dp × pp processes (rank r is stage r % pp of pipeline r // pp),
# and the sampler takes the dp coordinate, as 09's does: the stages of one pipeline see the same
# samples. DDP is gone (its reducer expects one backward after each forward; GPipe runs every forward
# first): `train` wraps the stage in the library's `PipelineStage` and a schedule (`ScheduleGPipe` or
# `Schedule1F1B`), and `_run_batch` calls `schedule.step` with the samples (first stage) or the labels
# (last), then averages the stage's gradients over the dp pipelines, once, and steps. Three more
# pieces come from no process holding the whole model:
#
# - the loss is `BatchMeanLoss`, and every batch is `padded` to the same number of rows (below:
#   why, and why it is still stage 01's training);
# - the held-out set goes through the pipeline too (`evaluate_pipeline`, the schedule's forward-only
#   `eval`), and instead of DDP's replica check each stage is compared with its copies in the other
#   dp pipelines;
# - the whole model is gathered from the stages only for `--out`'s `model.pt` (`gathered_model`), and
#   the weights and momentum after each epoch, which the tour replays, are recorded only with `--out`
#   (`WholeTrajectory`, below the lesson's end).

# %%
nb.show_diff("05_multinode", "10_pipeline_parallel")

# %% [markdown]
# ## Run it
#
# Stage 01 with one process of batch 64, then stage 10 under `torchrun` with two processes and
# `--pp 2`: a mesh of dp 1 × pp 2, one pipeline of two stages. Both stages load the same 64 samples
# a step (the first uses the samples, the last the labels), so `--batch-size 64` is the global batch,
# stage 01's; the schedule cuts it into 4 micro-batches of 16 and runs them under 1F1B, the default.

# %%
ref = nb.reference(cfg)
pp_run = nb.run(cfg.step("10_pipeline_parallel"), "10_pipeline_parallel")
s = pp_run.summary
pp, m = s["pp"], s["microbatches"]
print(f"mesh: dp {s['dp']} × pp {pp}; {m} micro-batches of {s['batch_size'] // m} under {s['schedule']}; "
      f"global batch {s['global_batch']}")
assert (s["dp"], pp, m, s["schedule"], s["global_batch"]) == (1, 2, 4, "1f1b", 64), s

# %% [markdown]
# ## Who holds what, and what crosses the cut
#
# `split_layers` (train.py's own) cuts the model's `Linear` layers, each with the ReLU after it, into
# `pp` runs. Each rank's layers below come from the layout the run recorded (its place in the mesh)
# and that function; the shapes say what a stage sends on for each micro-batch.

# %%
s10 = nb.load_stage("10_pipeline_parallel")
whole = s10.Net()
names = {id(module): name for name, module in whole.named_modules()}
stages = s10.split_layers(whole, pp)
assert [p for st in stages for p in st.parameters()] == list(whole.parameters())  # every weight, once, in order
mb_size = s["batch_size"] // m
for p in sorted(s["layout"], key=lambda p: p["rank"]):
    linears = [module for module in stages[p["pp"]] if isinstance(module, torch.nn.Linear)]
    layers = [names[id(module)] for module in linears]
    assert layers == s10.STAGE_LAYERS[pp][p["pp"]], (layers, p)
    sends = (f"sends {mb_size} × {linears[-1].out_features} activations on, per micro-batch"
             if p["pp"] < pp - 1 else "computes the loss")
    gets = (f"receives {mb_size} × {linears[0].in_features}" if p["pp"] > 0 else "reads the samples")
    print(f"rank {p['rank']} (dp {p['dp']}, pp {p['pp']}): " + ", ".join(
          f"{n} {linear.in_features} → {linear.out_features}" for n, linear in zip(layers, linears, strict=True))
          + f"; {sum(t.numel() for t in stages[p['pp']].parameters())} weights; {gets}, {sends}")
for a, b in zip(stages, stages[1:], strict=False):  # what one stage sends is what the next takes in
    assert [x for x in a if isinstance(x, torch.nn.Linear)][-1].out_features == b[0].in_features

# %% [markdown]
# ## Any number of micro-batches, any batch: padding and `BatchMeanLoss`
#
# torch's schedule cuts a batch into M micro-batches of equal size, and sizes every stage's receive
# buffers at its first step. So a batch that M does not divide, or an epoch's last batch when the
# batch size does not divide the samples, would not fit. The stage pads every batch to the same
# `rows` (the batch size rounded up to a multiple of M) with rows labelled `IGNORE` (-100, which
# `cross_entropy` leaves out of the loss and its gradients). The padding costs some compute and
# changes nothing else.
#
# The loss must then count samples, not micro-batches. The library's default divides each
# micro-batch's mean by M, which is the batch's mean only when the micro-batches hold equal numbers
# of samples. `BatchMeanLoss` sums a micro-batch's losses and divides by the batch's real samples:
# added over the micro-batches, however the batch was cut, that is the batch's mean (and the schedule
# is built with `scale_grads=False`, so nothing divides again). Two batches, with stage 10's own
# `padded` and `BatchMeanLoss`, against the mean that stage 01 takes:

# %%
torch.manual_seed(0)
net = s10.Net().double()
data, _ = s10.make_data(0, torch.float64)
loss_fn = s10.BatchMeanLoss()
for samples, batch, micro in ((64, 64, 3), (16, 48, 4)):  # a batch of 64 cut 3 ways; 16 (the last at batch 48), 4
    x, y = data.tensors[0][:samples], data.tensors[1][:samples]
    rows = -(-batch // micro) * micro  # as train.py: the batch size rounded up to a multiple of M
    xp, yp = s10.padded(x, y, rows)
    pieces = list(zip(xp.tensor_split(micro), yp.tensor_split(micro), strict=True))
    loss_fn.samples = samples
    ours = sum(loss_fn(net(a), b) for a, b in pieces)
    means = sum(F.cross_entropy(net(a), b, ignore_index=s10.IGNORE) for a, b in pieces) / micro
    print(f"{samples} samples padded to {rows} rows, {micro} micro-batches of "
          f"{[int((b != s10.IGNORE).sum()) for _, b in pieces]} real samples: stage 01's mean "
          f"{F.cross_entropy(net(x), y).item():.12f} | BatchMeanLoss summed {ours.item():.12f} | "
          f"micro-batch means averaged {means.item():.12f}")
    assert abs(ours.item() - F.cross_entropy(net(x), y).item()) < 1e-12

# %% [markdown]
# Averaging the micro-batches' means weighs the samples of a short micro-batch more, and a
# micro-batch of padding alone is 0 / 0 (`nan`). The sum over the batch's samples has neither
# problem. A real run with both cases: `--batch-size 48 --microbatches 5` pads each batch to 50
# rows, and each epoch's last batch holds 16 samples (4,096 = 85 × 48 + 16). The stage says so before
# training, and one epoch of it replays with stage 01's code at batch 48.

# %%
odd_step = nb.with_args(cfg.step("10_pipeline_parallel"), batch_size=48, microbatches=5, epochs=1)
odd = nb.run(odd_step, "10_padded")
error = nb.replay_error(odd.summary, odd.trajectory)
print(f"batch 48 in 5 micro-batches, 1 epoch: replayed with stage 01's code at batch 48 to {error:.1e}")
assert error <= nb.ATOL, error

# %% [markdown]
# ## Same weights as stage 01
#
# The pipelined run against stage 01: the same final weights within the tour's float64 tolerance,
# and every epoch replayed by stage 01's code.
#
# No process holds the whole model, so two more checks replace DDP's replica check. The copies of
# each stage in the dp pipelines averaged the same gradients, so they must be equal (the run's
# `pipelines: max |difference| ...` line, `replica_max_abs_diff` in its summary; with dp 1, as here,
# a stage has no copy and it is 0 trivially). And the run scored the held-out set through the
# pipeline, micro-batch by micro-batch; stage 01's own `evaluate()` on the gathered `model.pt`, in
# this kernel, must give the same numbers.

# %%
label = f"10, dp {s['dp']} × pp {pp}, {s['schedule']}"
print(f"pipelines: a stage differs from its copy in pipeline 0 by at most {s['replica_max_abs_diff']} "
      f"(dp {s['dp']})")
assert s["replica_max_abs_diff"] == 0.0
loss01, acc01, count01 = nb.held_out_by_01(pp_run)
print(f"held-out, through the pipeline (the run):  loss {s['eval_loss']:.12f} | accuracy {s['eval_accuracy']:.2%} "
      f"({s['eval_count']} samples)")
print(f"held-out, stage 01's evaluate(model.pt):   loss {loss01:.12f} | accuracy {acc01:.2%} ({count01} samples)")
assert (s["eval_count"], s["eval_accuracy"]) == (count01, acc01), (s["eval_count"], s["eval_accuracy"], count01, acc01)
assert abs(s["eval_loss"] - loss01) <= nb.ATOL, (s["eval_loss"], loss01)
diffs = nb.compare(ref, {label: pp_run})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {label: pp_run}, "10 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## The schedules by hand, and a measured timeline
#
# `by_hand.py` is `train.py` with the library's schedule replaced by the two functions drawn above,
# on point-to-point messages: the schedules give each stage its order of forwards and backwards, and
# class `Pipe` runs it. Before each computation one `batch_isend_irecv` sends what the previous one
# made (activations on, or a gradient back) and receives what this one needs, posted together so that
# no pair of stages can each wait for the other (NCCL's sends finish only once received). It keeps
# each micro-batch's activations until its backward. With `--out` it also records when each forward
# and backward computed, on every rank, in the last step (`timelines`), and the most micro-batches
# each rank held (`peak_held`).
# Here it runs GPipe for 2 epochs at the tour's settings otherwise.

# %%
hand_step = nb.with_args(cfg.step("10_pipeline_parallel"), epochs=2, schedule="gpipe")
hand_out = nb.RUNS / "10_by_hand_gpipe"
hand_run = nb.run(hand_step.commands(out=hand_out, script=nb.ROOT / "10_pipeline_parallel" / "by_hand.py"),
                  hand_out.name)
h = hand_run.summary
assert (h["schedule"], h["pp"], h["microbatches"], h["epochs"]) == ("gpipe", pp, m, 2), h

# %% [markdown]
# The order of the forwards and backwards changes *when* each gradient is computed, not the sums: in
# either, each micro-batch's loss is its share of the batch's mean (`BatchMeanLoss`, the same in
# both files), and its gradient is added to `.grad` in turn, micro-batch 0 first. So GPipe written
# by hand ends its 2 epochs at the weights the library's 1F1B held after its first 2, **to the
# bit**, with the same losses.

# %%
after_two = pp_run.trajectory[2]
assert after_two["epoch"] == 2
same = all(torch.equal(hand_run.model[k], t) for k, t in zip(hand_run.model, after_two["params"], strict=True))
print(f"by hand, GPipe, after 2 epochs vs the library's 1F1B after 2: identical weights: {same}; "
      f"losses {h['losses']} vs {s['losses'][:2]}")
assert same and h["losses"] == s["losses"][:2], (h["losses"], s["losses"][:2])

# %% [markdown]
# Below, the last step of that run as each stage measured it, on one clock (the clock of this
# machine, from the step's first forward), above the same schedule played on the slot clock. The
# arrows are the sends: activations down after each forward, gradients up after each backward. Each
# stage's order is the function's; and no stage starts a micro-batch before its neighbour has: stage 1
# waits for each forward's activations, stage 0 for each backward's gradient. On this CPU the model is
# tiny: a forward of 16 samples takes a fraction of a millisecond (printed below), the arrows show
# how long each message took next to it, and the stages are uneven (stage 1 has two layers), so the
# bubble measured is above the formula's. `benchmarks/pipeline_bubble.py` measures it on a model
# large enough for the compute to fill the timeline. (On GPUs these stamps would time the launches of
# the kernels, not the kernels: the dependencies are checked on the CPU only.)

# %%
stamps = h["timelines"]  # per rank: [kind, micro-batch, start, end], seconds
t0 = min(start for line in stamps for _, _, start, _ in line)
measured = [[(kind, mb, (start - t0) * 1e3, (end - t0) * 1e3) for kind, mb, start, end in line] for line in stamps]
played = pb.slot_clock(hand, "gpipe", pp, m)
orders = [[f"{kind}{mb}" for kind, mb, *_ in line] for line in measured]
assert orders == [[f"{kind}{mb}" for kind, mb, *_ in line] for line in played["timelines"]], orders
assert orders == [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]] * pp, orders
at = {(kind, mb, st): (start, end) for st, line in enumerate(measured) for kind, mb, start, end in line}
if h["device"] == "cpu":  # gloo's recv blocks until the message is there; nccl's only queues it on the GPU
    for st in range(pp - 1):  # a failure here: a stage ahead of its neighbour, or the stamps not on one clock
        for mb in range(m):
            assert at["F", mb, st + 1][0] > at["F", mb, st][0], f"stage {st + 1} started F{mb} before stage {st}"
            assert at["B", mb, st][0] > at["B", mb, st + 1][0], f"stage {st} started B{mb} before stage {st + 1}"
    assert pb.bubble(measured) > pb.theory(pp, m), (pb.bubble(measured), pb.theory(pp, m))

fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 5.4))
draw(ax, measured, f"measured: the last step of by_hand.py --schedule gpipe, P = {pp}, M = {m} "
     f"({h['device']}): bubble {pb.bubble(measured):.0%}", "ms")
for mb in range(m):
    for st in range(pp - 1):
        for src, dst, kind in ((st, st + 1, "F"), (st + 1, st, "B")):
            ax.annotate("", (at[kind, mb, dst][0], dst), (at[kind, mb, src][1], src),
                        arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 0.8, "shrinkA": 0, "shrinkB": 0})
draw(bx, played["timelines"], f"the same schedule on the slot clock: bubble {played['bubble']:.0%} "
     f"= (P − 1) / (M + P − 1)", "slots (a forward 1, a backward 2)")
fig.tight_layout()
nb.show(fig)
for st, line in enumerate(measured):
    f_ms = [end - start for kind, _, start, end in line if kind == "F"]
    b_ms = [end - start for kind, _, start, end in line if kind == "B"]
    print(f"stage {st}: forwards {sum(f_ms) / len(f_ms):.3f} ms, backwards {sum(b_ms) / len(b_ms):.3f} ms on "
          f"average; busy {sum(f_ms) + sum(b_ms):.2f} ms of the {line[-1][3] - line[0][2]:.2f} ms from its first "
          f"start to its last end")
print(f"bubble measured {pb.bubble(measured):.0%}; (P − 1) / (M + P − 1) = {pb.theory(pp, m):.0%}")

# %% [markdown]
# ## Activations held at peak
#
# `Pipe` counts the micro-batches whose activations it keeps for their backward; the run reported
# each rank's most. Under GPipe every stage held all M. The slot clock's stand-in for `Pipe` counts
# the same way through the same schedule functions, and gives 1F1B's: P − s on stage s.

# %%
played_1f1b = pb.slot_clock(hand, "1f1b", pp, m)
print(f"P = {pp}, M = {m}: activations held at most, per stage")
print(f"  GPipe, measured by by_hand.py: {h['peak_held']}   (M = {m} on every stage)")
print(f"  GPipe, on the slot clock:      {played['peak_held']}")
print(f"  1F1B, on the slot clock:       {played_1f1b['peak_held']}   (P − s on stage s)")
assert h["peak_held"] == played["peak_held"] == [m] * pp, (h["peak_held"], played["peak_held"])
assert played_1f1b["peak_held"] == [pp - st for st in range(pp)], played_1f1b["peak_held"]

# %% [markdown]
# Here a micro-batch's activations are 16 × 64 numbers, and holding 4 instead of 2 costs nothing.
# In a large model they are what fills the memory, and M is what shrinks the bubble: 1F1B is what
# lets M grow.
#
# ## Smaller bubbles: interleaved 1F1B and ZB-H1, as they ran
#
# `schedules.py` adds the two schedules large runs use. **Interleaved 1F1B** gives each rank v
# stages, placed round-robin (rank r holds r, r + P, …): filling and draining the pipeline costs 1/v
# as much, a bubble of (P − 1)/(v·M + P − 1). **ZB-H1** splits each backward into B, the gradient of
# the stage's input, sent at once, and W, the weights' gradients, run later where the rank would
# wait: with F, B and W equally long, (P − 1)/(3M + P − 1). It runs them beside GPipe and 1F1B on a
# deeper MLP (8 Linear layers), each from the same weights, and records every computation: rank,
# stage, micro-batch, kind, start, end. One step of each at P = 2, M = 4, drawn by `timeline.py`
# from that record. The layers here are small, so messages and Python weigh as much as the compute
# and the measured bubble sits above the formula's; the order on each rank and the activations held
# are the schedule's.

# %%
sched_dir = nb.ROOT / "10_pipeline_parallel"
sched_step = nb.Step("10_pipeline_parallel", "torchrun", ("--microbatches", "4", "--steps", "1"), nproc=2)
sched_run = nb.run(sched_step.commands(out=nb.RUNS / "10_schedules", script=sched_dir / "schedules.py"), "10_schedules")
print(sched_run.stdout.strip())
record = json.loads((sched_run.out / "schedules.json").read_text())
held = {r["schedule"]: r["peak_held"] for r in record}
assert held == {"gpipe": [4, 4], "1f1b": [2, 1], "interleaved": [5, 3], "zbh1": [2, 2]}, held
timeline = runpy.run_path(str(sched_dir / "timeline.py"))  # its functions, by name
nb.show(timeline["draw"](record))

# %% [markdown]
# Interleaved's rank 0 holds 5 (stage, micro-batch) activations at its peak, each half its layers:
# 2.5 ranks' worth against 1F1B's 2. ZB-H1's ranks hold 2 each: a micro-batch's activations stay
# until its W, and rank 1 runs each W one backward late. `tests/test_pipeline_schedules.py` checks
# every schedule against one process's training and each rank's order against the schedule's table.
#
# ## Also in the stage, not run here
#
# - With 4 processes, `--pp 2` makes two pipelines of two stages (dp 2 × pp 2): they train on
#   different samples, and each stage averages its gradients with its twin in the other pipeline,
#   once per step (`tests/test_pipeline.py` runs it, at stage 01's global batch).
# - `--microbatches 1 --schedule 1f1b` is refused in one line: 1F1B's warm-up needs at least one
#   micro-batch per stage. GPipe runs any M, and M need not divide `--batch-size` (padding, above).
# - `benchmarks/pipeline_bubble.py` measures the bubble of both schedules against M, on the wall
#   clock with a larger model, and on the slot clock for P = 2, 3, 4
#   ([its figure](../benchmarks/pipeline_bubble.png), and `10_pipeline_parallel/README.md`).
#
# When to pick which: DDP while a replica fits on one device; FSDP when its state does not; tensor
# parallelism inside a node, for layers too large for one device; a pipeline across nodes, when the
# model is too deep for one node, with its bubble kept small by many micro-batches.
