-- Global concurrency limits (issue #16): at most max_running jobs leased at
-- once per kind ('kind', KIND) or per concurrency key ('key', KEY), across
-- every dispatcher. The ordinary lease statements skip limited jobs; the
-- dispatchers lease them with lease_limited, one at a time (an advisory
-- lock), counting what runs (docs/design.md, "Concurrency limits").
CREATE TABLE gpuq.limits (
    scope       text NOT NULL CONSTRAINT limits_scope_check CHECK (scope IN ('kind', 'key')),
    name        text NOT NULL,
    max_running int NOT NULL CONSTRAINT limits_max_check CHECK (max_running >= 0),
    PRIMARY KEY (scope, name)
);

-- What runs under each key: only keyed jobs enter it.
CREATE INDEX jobs_running_key_idx ON gpuq.jobs (concurrency_key)
    WHERE status = 'leased' AND concurrency_key IS NOT NULL;
