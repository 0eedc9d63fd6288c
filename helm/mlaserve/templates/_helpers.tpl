{{/*
Helpers of the mlaserve chart: labels, the etcd endpoints, the model volume and mount.
*/}}

{{/* Labels every object of the release carries. */}}
{{- define "mlaserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{/* The etcd endpoints routers and workers use: the in-chart Service or the external list. */}}
{{- define "mlaserve.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}{{ .Release.Name }}-etcd:{{ .Values.etcd.clientPort }}{{ else }}{{ .Values.etcd.externalEndpoints }}{{ end }}
{{- end }}

{{/* The model volume (a PVC) when model.persistentVolumeClaim.enabled. */}}
{{- define "mlaserve.modelVolume" -}}
{{- if .Values.model.persistentVolumeClaim.enabled }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.persistentVolumeClaim.claimName }}
    readOnly: true
{{- end }}
{{- end }}

{{/* Its mount. */}}
{{- define "mlaserve.modelMount" -}}
{{- if .Values.model.persistentVolumeClaim.enabled }}
- name: model
  mountPath: {{ .Values.model.persistentVolumeClaim.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The Secrets of security.apiKeys and security.tls, as volumes. */}}
{{- define "mlaserve.securityVolumes" -}}
{{- if .Values.security.apiKeys.secretName }}
- name: api-keys
  secret:
    secretName: {{ .Values.security.apiKeys.secretName }}
{{- end }}
{{- if .Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.security.tls.secretName }}
{{- end }}
{{- end }}

{{/* Their mounts (the router mounts both, a worker only the TLS Secret). */}}
{{- define "mlaserve.apiKeysMount" -}}
{{- if .Values.security.apiKeys.secretName }}
- name: api-keys
  mountPath: /etc/mlaserve/api-keys
  readOnly: true
{{- end }}
{{- end }}

{{- define "mlaserve.tlsMount" -}}
{{- if .Values.security.tls.enabled }}
- name: tls
  mountPath: /etc/mlaserve/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The port probes read gRPC health on: the plain-text health port while TLS is on. */}}
{{- define "mlaserve.probePort" -}}
{{- if .root.Values.security.tls.enabled }}{{ .root.Values.security.tls.healthPort }}{{ else }}{{ .port }}{{ end }}
{{- end }}
