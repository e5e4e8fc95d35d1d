"""One transformers load at a time in this process.

transformers' from_pretrained is not safe in two threads at once: two loads of a model with tied embeddings left
the lm_head of both on the meta device, untied (18 of 20 loads of a tiny tied model, two threads at once; seen as
"Tensor on device meta" when a test's load overlapped another's). The app's model slot loads one model at a time
anyway; this lock holds for every other caller too (the SmolLM2 conversion, tests, a script). A module of its own:
the backbone's load and the conversion both take it, and the conversion is below the load.
"""

import threading

TRANSFORMERS_LOADS = threading.Lock()
