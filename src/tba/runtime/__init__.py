"""Where the searchers run, inside the trainer process or as Ray actors on a local or remote
cluster, behind one interface (`tba.runtime.searchers.Searchers`); and how their samples reach the
trainer's buffer in each training mode (`tba.runtime.feed`)."""
