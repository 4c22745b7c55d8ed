# The two commands of the README, and a few more for development.
.PHONY: demo test bench install lint

demo:        ## Enqueue events on throwaway servers and watch them arrive in Redis
	scripts/demo.sh

test:        ## Every test: lints, unit tests, integration tests against real servers
	scripts/test.sh

bench:       ## Write cost, relay throughput, latency; prints a Markdown table
	scripts/bench.sh

install:     ## Build (release) and install into the system's PostgreSQL
	scripts/setup.sh && scripts/install.sh --release

lint:
	cargo fmt --all -- --check && cargo clippy --all-targets -- -D warnings
