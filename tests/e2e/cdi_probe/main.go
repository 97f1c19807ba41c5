// Command probe is the only program of the image tests/e2e/test_podman_cdi.py builds: it prints the
// container's environment and, for each path argument, whether it exists, its mode and, for a
// symbolic link, where it points, so the test can see what the container runtime injected from a CDI
// spec (and what the spec's hooks made).
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
		if target, err := os.Readlink(p); err == nil {
			fmt.Println("link", p, target)
		}
		if st, err := os.Stat(p); err == nil {
			fmt.Println("path", p, st.Mode().String())
		} else {
			fmt.Println("missing", p)
		}
	}
}
