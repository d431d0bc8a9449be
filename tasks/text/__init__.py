"""Text helpers below both training (quality/) and serving (serving/): how a prompt becomes token ids and how a
streamed answer is cut into deltas. Standard library only; copied into every rendered Triton model folder."""
