// Command cdischema validates CDI spec files against the CDI project's built-in JSON schema, as
// loaded by the reference library (cdi.SetSpecValidator with schema.BuiltinSchema, then cdi.ReadSpec).
//
// It is a module of its own because the library moved its schema package into a separate
// module after v0.8; that module is not served by the Go module proxy, so this check pins the
// last library release that still ships the schema in-tree. The semantic checks, the cache and
// device injection are exercised with the current library (v1.1.0) in goclient/e2e.
//
// Usage: cdischema FILE...   (exit status 1 if any file fails)
package main

import (
	"fmt"
	"os"

	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/schema"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdischema FILE...")
		os.Exit(2)
	}
	builtin := schema.BuiltinSchema()
	cdi.SetSpecValidator(func(s *cdispec.Spec) error { return builtin.ValidateType(s) })
	failed := 0
	for _, path := range os.Args[1:] {
		spec, err := cdi.ReadSpec(path, 0)
		if err != nil {
			failed++
			fmt.Printf("FAIL %s: %v\n", path, err)
			continue
		}
		fmt.Printf("ok   %s: %s, %d device(s)\n", path, spec.GetClass(), len(spec.Devices))
	}
	if failed > 0 {
		os.Exit(1)
	}
}
