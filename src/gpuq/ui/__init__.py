"""The operator dashboard at /ui on ``gpuq serve``'s port (docs/dashboard.md).

- ``auth``: dashboard tokens, signed session cookies, CSRF tokens (pure);
- ``params``: what a request's query string means, checked (pure);
- ``views``: what each page shows, from the server's state and indexed queries;
- ``actions``: what an admin can do, each the CLI's own function;
- ``shared``: one read per key a second, however many pages are open;
- ``trend``: the overview's last hour, sampled into memory;
- ``web``: the HTTP side (pages, login, actions, static files) and the /ui/live websocket.

Templates (Jinja2, autoescaped) in ``templates/``; the vendored htmx 2.0.11 and
its websocket extension 2.0.4 (0BSD) in ``static/``: nothing to build.
"""
