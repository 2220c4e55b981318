"""The app's routes, one module per concern: :mod:`.system` (``/``, ``/health``, ``/v1/models``, ``/metrics``),
:mod:`.completions` (``/v1/completions``, ``/v1/chat/completions``) and :mod:`.translations`
(``/v1/translations``). Each route is a plain function that finds the app's
:class:`~tokenloom.serving.state.ServerState` through its request; each module's ``add_routes(router, ...)`` puts
its routes on a router (the app's own, ``app.router``), with the published schema of the served model."""
