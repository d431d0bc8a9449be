"""What the train stage shares with the commands and the cluster: its distributed launch, its checkpoints,
its memory plan and the Kubernetes objects that start its nodes."""
