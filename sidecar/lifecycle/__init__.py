"""The lifecycle: the facade, its transactions, the reconciler and the Recover transaction."""
