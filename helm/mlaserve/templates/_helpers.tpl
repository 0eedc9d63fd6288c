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
