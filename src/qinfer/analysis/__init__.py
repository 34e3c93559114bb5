"""Looking into a loaded model rather than serving it: one prompt's attention weights,
next-token probabilities and logit lens (`inspection`), drawn as a PNG (`heatmap`), and a
text's perplexity and KL divergence from a reference (`perplexity`, as llama.cpp's
llama-perplexity scores it)."""
