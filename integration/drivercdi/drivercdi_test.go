package drivercdi

import (
	"strings"
	"testing"
)

func TestADriverRootWithoutTheDriverGivesNoSpec(t *testing.T) {
	_, err := Spec(Options{DriverRoot: t.TempDir(), HookPath: "/usr/bin/nvidia-cdi-hook", Kind: "k8s.hami.io/mig-driver", Name: "common"})
	if err == nil || !strings.Contains(err.Error(), "libcuda.so") {
		t.Fatalf("a root without libcuda.so.<version>: %v", err)
	}
}

func TestAKindThatIsNotVendorSlashClassIsRefused(t *testing.T) {
	for _, kind := range []string{"", "mig", "k8s.hami.io/", "/mig", "a/b/c"} {
		if _, err := Spec(Options{DriverRoot: t.TempDir(), Kind: kind, Name: "common"}); err == nil || !strings.Contains(err.Error(), "vendor/class") {
			t.Errorf("kind %q: %v", kind, err)
		}
	}
}
