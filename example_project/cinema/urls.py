from django.urls import path

from . import views

app_name = "cinema"
urlpatterns = [
    path("", views.book, name="book"),
    path("bookings/", views.bookings, name="bookings"),
]
