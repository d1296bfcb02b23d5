"""The course's interactive simulators, each a plain-Python controller over the live engine
with a thin ipywidgets view (chapters 1, 3-13 and 14, plus every chapter's quiz).

=====================  ==================================  ==========================
view                   controller                          chapters
=====================  ==================================  ==========================
BlockAllocatorView     BlockAllocatorController            4 (PagedAttention), 7
SchedulerStepper       SchedulerStepperController          5 (the scheduler)
StepCostExplorer       StepCostFit, explore                6 (prefill vs decode)
SamplingPlayground     SamplingPlaygroundController        8 (sampling)
TPStepper              TPStepperController                 9 (tensor parallelism)
ThroughputExplorer     ThroughputExplorerController        11 (benchmarks)
SpecDecodeStepper      SpecDecodeStepperController         13 (speculative decoding)
StructuredOutputStepper  StructuredOutputStepperController  14 (structured output)
MemoryEstimator        MemoryEstimatorController           1, 3
TokenEditor            token_pieces (widgets.tokens)       1
Quiz                   QuizController                      all fourteen
=====================  ==================================  ==========================

The step-cost and throughput explorers are driven by their chapter's own measurements (a
line fitted to measured steps; the measured online runs), not by a live engine, so they stay
usable whatever later cells did to the engine; the TP stepper splits one real layer's weights
and never steps an engine.

Controllers use only the engine's public API (``add_request``, ``step``, ``abort``,
``snapshot``, ``events``, ``next_token_logits``) and the sampler's public functions; the
engine never imports this package. A bad value typed into a control is shown as a message
in the widget and leaves the engine unchanged.

Views that watch an engine (the stepper, the allocator) redraw after every engine step,
whoever ran it. Which simulators share an engine is decided per notebook, and a view says
so on screen (``shared_with=``): in the widgets demo the sampling playground and the
scheduler stepper share the real model (loading it twice would cost seconds and memory)
while the block allocator has a tiny engine of its own; in chapter 4 the allocator has its
own tiny engine and nothing else steps it.
"""

from widgets._common import default_engine, single_thread, tiny_engine
from widgets.block_allocator import BlockAllocatorController, BlockAllocatorView, ContiguousAllocator
from widgets.memory_estimator import MemoryEstimator, MemoryEstimatorController
from widgets.quiz import Quiz, QuizController, load_quiz
from widgets.sampling_playground import SamplingPlayground, SamplingPlaygroundController
from widgets.scheduler_stepper import SchedulerStepper, SchedulerStepperController
from widgets.spec_decode_stepper import SpecDecodeStepper, SpecDecodeStepperController
from widgets.structured_output_stepper import StructuredOutputStepper, StructuredOutputStepperController
from widgets.step_cost_explorer import StepCostExplorer, StepCostFit
from widgets.throughput_explorer import ThroughputExplorer, ThroughputExplorerController
from widgets.tokens import TokenEditor, token_chips, token_pieces
from widgets.tp_stepper import TPStepper, TPStepperController

__all__ = ["BlockAllocatorController", "BlockAllocatorView", "ContiguousAllocator", "MemoryEstimator",
           "MemoryEstimatorController", "Quiz", "QuizController", "load_quiz", "SamplingPlayground",
           "SamplingPlaygroundController", "SchedulerStepper", "SchedulerStepperController",
           "SpecDecodeStepper", "SpecDecodeStepperController", "StructuredOutputStepper", "StructuredOutputStepperController",
           "StepCostExplorer", "StepCostFit", "ThroughputExplorer", "ThroughputExplorerController",
           "TPStepper", "TPStepperController", "TokenEditor", "default_engine", "single_thread", "tiny_engine", "token_chips", "token_pieces"]
