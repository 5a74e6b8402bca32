"""Training idioms for the differential semantics suite (``test_semantics.py``).

Each idiom is a function returning ``(model, batches)``: a small fp32 module that uses one construct
whose autograd or state semantics a graph capture can get wrong, and a list of input tuples, one per
training step. The model's output is reduced to a loss by ``reduce_output`` (a scalar, a tuple, a
dict or a Hugging Face ``ModelOutput``). Side effects the model records (a hook's log) live in
``model.log``, a list the suite compares too.
"""
from idioms_autograd import GradReverse  # noqa: F401  (registers the autograd idioms)
from idioms_base import IDIOMS, reduce_output  # noqa: F401
from idioms_stacks import random_stack  # noqa: F401
import idioms_state  # noqa: F401,E402  (registers the state idioms)
