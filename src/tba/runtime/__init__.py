"""Where the searchers run and how their samples reach the trainer: the trainer's view of its
searchers (`searchers`), one searcher inside the trainer process (`in_process`), searchers as Ray
actors (`ray_pool`, `ray_actor`, `ray_cluster`), choosing between them (`launch`), and the feed
of samples into the buffer, the one place the two training modes differ (`feed`)."""
