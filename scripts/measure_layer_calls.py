"""The 30 decoder layers of one decode step, one native call each against their Python forward (results/README.md).

    OMP_NUM_THREADS=2 NANOENGINE_HUGE_PAGE_SECONDS=inf PYTHONPATH=$PWD .venv/bin/python \
        scripts/measure_layer_calls.py BATCH

One default engine; a decode step of BATCH requests (64-token prompts) is captured (its input
ids, positions and metadata), then the model's layers are run on it directly, alternately as
their one native call and as their Python forward, 30 times each; the medians in ms. The step's
K/V slots are written again each time, with the same values.
"""

import statistics
import sys
import time

import torch

from nanoengine import LLM, SamplingParams

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
llm = LLM()
engine = llm.engine
model = engine.runner.model
gen = torch.Generator().manual_seed(batch)
ids = [engine.add_request(torch.randint(100, 40000, (64,), generator=gen).tolist(),
                          SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)) for _ in range(batch)]
while any(engine.requests[i].num_output_tokens == 0 for i in ids):
    engine.step()
captured = {}
forward = type(model.model).forward


def capture(self, input_ids, positions, meta):
    captured["step"] = (input_ids, positions, meta)
    return forward(self, input_ids, positions, meta)


type(model.model).forward = capture
engine.step()  # a decode step of every request
type(model.model).forward = forward
input_ids, positions, meta = captured["step"]
assert meta.num_decode_tokens == batch and meta.one_call_layers
times = {True: [], False: []}
with torch.inference_mode():
    hidden = model.model.embed_tokens(input_ids)
    rows = model.model.rotary_emb.rows(positions)
    for _ in range(30):
        for one_call in (True, False):
            meta.one_call_layers = one_call
            h, residual = hidden, None
            start = time.perf_counter()
            for layer in model.model.layers:
                h, residual = layer(h, residual, meta, rows)
            times[one_call].append(time.perf_counter() - start)
for one_call, values in times.items():
    print(f"batch {batch}: {'one native call per layer' if one_call else 'the Python forward':26s} "
          f"{statistics.median(values) * 1e3:.2f} ms for {len(model.model.layers)} layers")
