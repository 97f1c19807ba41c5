module github.com/Project-HAMi/hami-mig-sidecar/integration/goclient

go 1.26.0

// Inside this repository the contract is built from ../../api. Go ignores this replace in a
// module that imports this one and uses the api release required below instead: a release tags
// the api module as api/vX.Y.Z and this one as integration/goclient/vX.Y.Z (see the README;
// module_test.go resolves the requirement as such a consumer would).
replace github.com/Project-HAMi/hami-mig-sidecar/api => ../../api

require (
	github.com/Project-HAMi/hami-mig-sidecar/api v0.1.0
	github.com/opencontainers/runtime-spec v1.3.0
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
	sigs.k8s.io/yaml v1.6.0
	tags.cncf.io/container-device-interface v1.1.0
)

require (
	github.com/fsnotify/fsnotify v1.5.1 // indirect
	github.com/moby/sys/capability v0.4.0 // indirect
	github.com/opencontainers/runtime-tools v0.9.1-0.20251114084447-edf4cb3d2116 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/mod v0.41.0 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.0 // indirect
)
