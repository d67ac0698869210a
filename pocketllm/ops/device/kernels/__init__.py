"""Triton kernels for the work between a prefill pass's GEMMs on a device, one file per kernel,
each file a kernel and its launcher with the signature of its torch form (../torch_forms.py).
Nothing imports these modules until a custom op runs on CUDA (../library.py) or a test asks, so
pocketllm.ops.device imports without Triton. On CPU the tests run them under Triton's interpreter
(tests/interpreted_device_kernels.py) and compile them for a GPU target."""
