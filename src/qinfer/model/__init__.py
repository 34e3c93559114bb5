"""The model as one callable: the `Transformer` built from a config (`transformer`), the
batch one forward runs (`forward_batch`), `load_model` (`loading`: build, then fill the
slots from a checkpoint) and the line a command prints once its model is loaded
(`announcer`). Nothing is imported here: `announcer` must stay free of torch."""
