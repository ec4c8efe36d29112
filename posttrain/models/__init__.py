"""Models: the trainable policy, generation backends, and the offline tiny-model builder."""
