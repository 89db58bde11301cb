"""``saoserve admin``: operators' commands over a running server's admin routes.

The command group is ``saoserve.admin.app.admin_app``; the commands live by subject
(``status``, ``learning``, ``evidence``, ``records``, ``lifecycle``, ``keys``,
``tenants``) over one HTTP
client (``client``: the calls, the exit codes, the one-line errors) and one way of printing
(``output``). Each command prints rich tables, or with ``--json`` the JSON a script reads.

The server's answers (server/admin/api_router.py, server/admin/protocol.py) are printed as given; these
modules only choose columns and format numbers.
"""
