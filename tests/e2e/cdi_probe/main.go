// Command probe is the only program of the image tests/e2e/test_podman_cdi.py builds: it prints the
// container's environment and, for each path argument, whether it exists and its mode, so the test
// can see what the container runtime injected from a CDI spec.
package main

import (
	"fmt"
	"os"
	"sort"
)

func main() {
	env := os.Environ()
	sort.Strings(env)
	for _, e := range env {
		fmt.Println("env", e)
	}
	for _, p := range os.Args[1:] {
		if st, err := os.Stat(p); err == nil {
			fmt.Println("path", p, st.Mode().String())
		} else {
			fmt.Println("missing", p)
		}
	}
}
