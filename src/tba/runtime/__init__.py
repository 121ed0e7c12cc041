"""Where the searchers run: inside the trainer process, or as Ray actors on a local or remote
cluster. The trainer talks to both through the same small interface (`publish`, `generate`,
`start`, `collect`, `close`)."""
