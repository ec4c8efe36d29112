"""Experience collection: single- and multi-turn rollouts against environments."""
