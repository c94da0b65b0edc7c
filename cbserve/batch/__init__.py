"""The `ray job submit` batch job: `python -m cbserve.batch --input prompts.jsonl --output results.jsonl`.

`job.py` runs a job, `backends.py` says where its requests run (engine actors or a Serve app),
`schema.py` defines its input and output lines, `requests.py` turns one into the other,
`io.py` resumes and appends the output, `progress.py` reports; `__main__.py` is the command line.
"""
