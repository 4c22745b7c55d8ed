# The two commands of the README, and a few more for development.
# PG=16 (or PG_CONFIG=/path/to/pg_config) picks one PostgreSQL; without either, `make test`
# runs the whole suite on every major tested here (15 to 19).
.PHONY: demo test test-matrix installcheck bench faults install package deb-check lint docs

demo:        ## Enqueue events on throwaway servers and watch them arrive in Redis (PACKAGE=1: from the .deb)
	PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" PACKAGE="$(PACKAGE)" scripts/demo.sh

test:        ## Every test: lints, unit tests, integration tests against real servers
	@if [ -n "$(PG)$(PG_CONFIG)" ]; then PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/test.sh; \
	else scripts/test-matrix.sh; fi

test-matrix: ## The suite on PostgreSQL 15 to 19, one after the other
	scripts/test-matrix.sh

installcheck: ## pg_regress and isolation specs (tests/regress, tests/isolation) on a throwaway server
	PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/setup.sh && PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/install.sh && \
	  PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/installcheck.sh

faults:      ## Faults at random against real servers: SEED=n (random if unset) MINUTES=m (10 if unset) SERVERS=all
	PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" SEED="$(SEED)" MINUTES="$(MINUTES)" SERVERS="$(SERVERS)" scripts/faults.sh

bench:       ## Write cost, relay throughput, latency; prints a Markdown table
	PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/bench.sh

package:     ## Debian packages and tarballs in target/package/, for PG (or every tested major)
	@if [ -n "$(PG)$(PG_CONFIG)" ]; then PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/setup.sh && \
	  PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/package.sh; \
	else for major in 15 16 17 18 19; do PG=$$major PG_CONFIG= scripts/setup.sh && \
	  PG=$$major PG_CONFIG= scripts/package.sh || exit 1; done; fi

deb-check:   ## dpkg -i the PostgreSQL 19 package on a Debian unstable root with Debian's postgresql-19, and relay
	PG=19 scripts/setup.sh && PG=19 scripts/package.sh && scripts/deb-check.sh

install:     ## Build (release) and install into the chosen PostgreSQL
	PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/setup.sh && PG="$(PG)" PG_CONFIG="$(PG_CONFIG)" scripts/install.sh --release

lint:        ## Formatting, Markdown links and clippy over the workspace: the extension and crates/ (PG=n: that major's build)
	cargo fmt --all -- --check && python3 scripts/check-links.py && \
	  cargo clippy --workspace --all-targets --no-default-features --features pg$(or $(PG),15) -- -D warnings

docs:        ## Draw docs/architecture.svg again from scripts/draw-architecture.py
	python3 scripts/draw-architecture.py
