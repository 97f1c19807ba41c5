{{/* The plugin's ServiceAccount as the API server names its user: the node restriction matches it. */}}
{{- define "hami-mig-dra.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:hami-mig-dra
{{- end -}}

{{/* An image reference from a value of image. */}}
{{- define "hami-mig-dra.image" -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
