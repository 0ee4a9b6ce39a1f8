"""FP8 training: the recipe, scales and casts, the FP8 GEMM, delayed scaling's update."""
