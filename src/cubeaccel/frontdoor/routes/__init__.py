"""The front door's E2B REST handlers, one class per resource built with the collaborators it uses (`sandboxes`,
`metrics`) and the stateless ones (`service`: health and the refused verbs). `frontdoor/app.py` joins them to
its route table (`REST_ROUTES`) by name; `common` reads what every route reads (the key, the body, the sandbox).
"""
