"""The front door's routes, one module per endpoint family; each module's `router` is included by
`serving.app.create_app`."""
