"""A draft model in ONNX Runtime: export from GGUF (export), the files of an export (files), and the runtime
(runtime, the only module that imports onnxruntime)."""
